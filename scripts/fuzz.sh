#!/usr/bin/env bash
# Runs the fuzz targets of fuzz/ (cargo-fuzz, libFuzzer), each for a bounded time, starting from
# the corpus kept in fuzz/corpus. Fails when a target finds an input that breaks it; the input
# is kept in fuzz/artifacts/<target>/ and the command that replays it is printed.
#
#   scripts/fuzz.sh [--seconds N] [--keep] [--clean] [TARGET...]
#
#   --seconds N  how long each target runs (default 20: about two minutes for all of them)
#   --keep       merge the inputs that reach new code into fuzz/corpus/<target> (to commit)
#   --clean      remove the targets' build (fuzz/target, about 3 GB) when done; CI does this
#   TARGET       the targets to run (default: every target of fuzz/Cargo.toml)
#
# cargo-fuzz is installed once into the cache ($EDGE_INGEST_CACHE, default ~/.cache/edge-ingest).
# The targets are built with the machine's stable toolchain (RUSTC_BOOTSTRAP=1 lets it take the
# flags cargo-fuzz passes) and without a sanitizer: the project's code forbids `unsafe`, so the
# checks that matter are Rust's own (overflow checks and debug assertions are on).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."


seconds=20
keep=0
clean=0
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --keep) keep=1; shift ;;
    --clean) clean=1; shift ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(sed -n 's/^name = "\(.*\)"/\1/p' fuzz/Cargo.toml | tail -n +2)
fi

log() { echo "fuzz: $*" >&2; }

cargo_fuzz_bin="$(scripts/cargo-tool.sh cargo-fuzz 0.13.2 2)"
export PATH="$cargo_fuzz_bin:$PATH"
export RUSTC_BOOTSTRAP=1
# The instrumented build shares nothing with the workspace's own builds (other flags, an explicit
# target triple), so it always goes to fuzz/target, wherever CARGO_TARGET_DIR points.
export CARGO_TARGET_DIR="$PWD/fuzz/target"
fuzz=(cargo fuzz run --fuzz-dir fuzz --sanitizer none)

log "building the targets (9 to 15 minutes from cold on 2 cores)"
cargo fuzz build --fuzz-dir fuzz --sanitizer none >&2

work="$(mktemp -d "${TMPDIR:-/tmp}/edge-ingest-fuzz.XXXXXX")"
if [ "$clean" = 1 ]; then
  trap 'rm -rf "$work" "$CARGO_TARGET_DIR"' EXIT
else
  trap 'rm -rf "$work"' EXIT
fi
failed=()
for target in "${targets[@]}"; do
  mkdir -p "$work/$target" "fuzz/corpus/$target"
  log "$target: ${seconds}s from $(find "fuzz/corpus/$target" -type f | wc -l) kept inputs"
  # New inputs go to the scratch corpus (the first directory); the kept one is only read.
  if "${fuzz[@]}" "$target" "$work/$target" "fuzz/corpus/$target" -- \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    >"$work/$target.log" 2>&1; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/$target.log" | tail -1)
    rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$work/$target.log" | tail -1)
    new=$(find "$work/$target" -type f | wc -l)
    log "$target: ${runs:-?} runs, $new new inputs, peak RSS ${rss:-?} MB, no finding"
  else
    tail -n 60 "$work/$target.log" >&2
    artifact=$(grep -oE 'fuzz/artifacts/[^ ]+' "$work/$target.log" | tail -1 || true)
    log "$target FAILED on ${artifact:-an input (see above)}"
    [ -n "$artifact" ] && log "replay: RUSTC_BOOTSTRAP=1 cargo fuzz run --fuzz-dir fuzz --sanitizer none $target $artifact"
    failed+=("$target")
    continue
  fi
  if [ "$keep" = 1 ]; then
    before=$(find "fuzz/corpus/$target" -type f | wc -l)
    "${fuzz[@]}" "$target" "fuzz/corpus/$target" "$work/$target" -- -merge=1 \
      >"$work/$target.merge.log" 2>&1 || { tail -n 20 "$work/$target.merge.log" >&2; failed+=("$target (merge)"); }
    log "$target: kept $(( $(find "fuzz/corpus/$target" -type f | wc -l) - before )) new inputs in fuzz/corpus/$target"
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  log "failed: ${failed[*]}"
  exit 1
fi
log "every target ran ${seconds}s without a finding: ${targets[*]}"
