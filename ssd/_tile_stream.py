"""The tile-stream kernel behind the benchmark's L2 ceiling (:func:`ssd.bench.tile_stream_rate`).

The stages load 2-D bf16 tiles of 64 x 64 (x, B, C, entering states: 8 KiB each) with TMA, and
many of those loads hit in L2 (B and C are shared by the heads of a group, x by the state slices
of stage 2). This kernel loads such tiles from a buffer, tile after tile, and nothing else, so
its rate over a buffer that fits in L2 is the most tile traffic the SMs can take from L2. It is
harness, not a stage: :data:`ssd.nbutil.KERNEL_CODE` leaves it out.
"""
import functools

import cuda.tile as ct

from ._launch import array_type, launch

STREAM_TILE = (64, 64)


@functools.lru_cache(maxsize=None)
def build_kernel():
    Array = array_type(ct.int32)

    @ct.kernel(occupancy=4)
    def tile_stream_kernel(src: Array, out: Array, tiles: int, loads: int):
        """Grid: (blocks,). Block i loads tiles i, i + blocks, ... (modulo ``tiles``) of ``src``
        until ``loads`` tiles have been loaded by all blocks, summing them in fp32 (stored, so
        that no load is dead)."""
        acc = ct.zeros(STREAM_TILE, dtype=ct.float32)
        for t in range(ct.bid(0), loads, ct.num_blocks(0)):
            acc = acc + ct.load(src, index=(t % tiles, 0), shape=STREAM_TILE).astype(ct.float32)
        ct.store(out, index=(ct.bid(0), 0), tile=acc)

    return tile_stream_kernel


def tile_stream(src, out, loads: int) -> None:
    """Launch it: ``src`` (rows, 64) bf16 with rows a multiple of 64; ``out`` (blocks * 64, 64)
    fp32, one block per 64 rows of ``out``; ``loads`` tiles loaded in all."""
    launch(build_kernel(), (out.shape[0] // STREAM_TILE[0], 1, 1),
           (src, out, src.shape[0] // STREAM_TILE[0], loads), device=src.device)
