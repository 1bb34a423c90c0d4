#!/bin/sh
# The wall clock to the microsecond, from adjtimex(2) (read only).
adjtimex | awk '/tv_sec/ {s = $2} /tv_usec/ {u = $2} END {printf "%d.%06d\n", s, u}'
