#!/usr/bin/env bash
# Bazel test (tag "fuzz") for one libFuzzer target: runs scripts/fuzz.sh of the source tree
# (found through this script's symlink; the root package does not export scripts/) with its
# outputs in the test's temporary directory.
#   bazel test --test_tag_filters=fuzz --test_env=FUZZ_SECONDS=30 //tests/reliability/...
set -euo pipefail
here="$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")"
export FUZZ_OUT="${TEST_TMPDIR}/fuzz"
exec bash "$here/../../../scripts/fuzz.sh" "$1"
