# untrack (and ignore) what a kernel call never reads; `away` before, `back` after
# (stop 39: the notebooks too, or .gpu and the tree came to more than the 64 MiB carried)
P="results/h200/previous book DESIGN.md notebooks"
S=results/h200/screening
case "$1" in
away) git rm -r -q --cached $P $S && for p in $P $S; do echo "/$p" >> .git/info/exclude; done ;;
back) sed -i '/^\/\(results\/h200\/previous\|notebooks\|book\|DESIGN.md\|results\/h200\/screening\)\/\?$/d' .git/info/exclude && git reset -q HEAD -- $P $S ;;
esac
git status --short | head -3; wc -l < .git/info/exclude
