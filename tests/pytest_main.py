"""Runs pytest on the test files given as arguments (the py_test entry point)."""
import os
import sys

import pytest

if __name__ == "__main__":
    args = sys.argv[1:]
    # Bazel's test runner sets XML_OUTPUT_FILE; keep pytest's cache out of the runfiles.
    extra = ["-p", "no:cacheprovider", "-q"]
    if os.environ.get("XML_OUTPUT_FILE"):
        extra += ["--junitxml", os.environ["XML_OUTPUT_FILE"]]
    sys.exit(pytest.main(extra + args))
