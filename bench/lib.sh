# Shared by the bench scripts (sourced, not run).

# Median of the arguments, rounded to an integer (median) or to one decimal (medianf).
median() { python3 -c 'import sys,statistics; print(round(statistics.median(map(float,sys.argv[1:]))))' "$@"; }
medianf() { python3 -c 'import sys,statistics; print(round(statistics.median(map(float,sys.argv[1:])), 1))' "$@"; }
