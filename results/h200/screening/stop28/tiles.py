"""Stop 28's hand model: bytes the tiles of each stage load and store (L2<->SM), per forward, and the rate
the recorded stage times imply. bf16 inputs and states; dt/dA ignored."""
import json
SH = {"130m": (8, 2048, 24, 64, 128, 1), "2.7b": (4, 4096, 80, 64, 128, 1),
      "long-16k": (1, 16384, 80, 64, 128, 1), "codestral-7b": (2, 8192, 128, 64, 128, 8),
      "small-state": (16, 1024, 32, 64, 64, 1)}
def stage2(b, l, h, p, n, q, bn):
    # fused walk: per (head, chunk): x read once per n-slice, B slice per block, states stored
    c = l // q
    return b * h * c * (q * p * 2 * (n // bn) + q * n * 2 + p * n * 2)
def scan(b, l, h, p, n, q, hb, shared):
    c = l // q
    m = q // 64
    if shared:   # per tile of hb heads: C, B once; per head x, prev, y once
        per_tile = q * n * 2 * 2 + hb * (q * p * 2 * 2 + p * n * 2)
    else:        # per row block: C rows, prev, B and x per column block (js <= im), y
        cols = m * (m + 1) // 2
        per_tile = m * (64 * n * 2 + hb * p * n * 2 + hb * 64 * p * 2) + cols * (64 * n * 2 + hb * 64 * p * 2)
    return b * c * (h // hb) * per_tile
for rev, f in (("c754dc3", "results/h200/models.json"), ("03bab93", "results/h200/screening/stop28/models-03bab93.json")):
    d = json.load(open(f))
    print(rev)
    for st in d["stages"]:
        s = st["shape"]; b, l, h, p, n, g = SH[s]; q = st["ssd_chunk_size"]
        bn = 32 if s == "long-16k" else (128 if s == "2.7b" else 64)
        small = s == "small-state"
        hb = 1 if small else 2
        sh = rev == "03bab93"
        t2, t3 = st["ssd"]["chunk_state+state_passing"], st["ssd"]["chunk_scan"]
        b2, b3 = stage2(b, l, h, p, n, q, bn), scan(b, l, h, p, n, q, hb, sh)
        print(f"  {s:13s} q{q} stage2 {b2/1e6:6.0f} MB {t2*1e3:6.1f} us {b2/t2/1e9:5.2f} TB/s | scan {b3/1e6:6.0f} MB {t3*1e3:6.1f} us {b3/t3/1e9:5.2f} TB/s")
print("prediction at q128 (wc sh, 5.3 TB/s), stage 2 with the q64 slices")
for s, (b, l, h, p, n, g) in SH.items():
    bn = 32 if s == "long-16k" else (64)
    for q, hb in ((64, 2), (128, 2), (128, 1)):
        b2, b3 = stage2(b, l, h, p, n, q, bn), scan(b, l, h, p, n, q, hb, True)
        print(f"  {s:13s} q{q} h{hb} stage2 {b2/1e6:6.0f} MB scan {b3/1e6:6.0f} MB sum {(b2+b3)/1e6:6.0f} MB -> {(b2+b3)/5.3e12*1e6:6.1f} us")
