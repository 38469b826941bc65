#!/bin/sh
# Builds the libFuzzer targets into $1 (default: fuzz/out) with clang,
# AddressSanitizer and UndefinedBehaviorSanitizer. Pure C: no Python needed.
#   fuzz/build.sh /tmp/fz && /tmp/fz/fuzz_config -runs=1000000 fuzz/corpus/config
# -DOC_PURE_C= (empty) matches the empty #define in src/config.c, so clang
# does not warn about a redefinition. -ftrivial-auto-var-init=pattern fills
# every local with 0xAA bytes: a buffer read before anything wrote to it (a
# string with no terminator) then fails a check instead of passing by luck.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/out}
cc=${CC_FUZZ:-clang}
mkdir -p "$out"
flags="-std=c11 -g -O1 -DOC_PURE_C= -D_GNU_SOURCE -Wall -Wextra -Werror
       -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
       -fno-omit-frame-pointer -ftrivial-auto-var-init=pattern"
# shellcheck disable=SC2086
$cc $flags -o "$out/fuzz_config" "$here/fuzz_config.c" "$here/../src/config.c" \
    "$here/../src/allocconf.c" "$here/../src/settings.c" "$here/../src/kbtable.c" -lm
# shellcheck disable=SC2086
$cc $flags -o "$out/fuzz_allocconf" "$here/fuzz_allocconf.c" "$here/../src/allocconf.c" \
    "$here/../src/settings.c"
