"""Re-exports the C++ action names Bazel 4.2.3 ships."""

load("@bazel_tools//tools/build_defs/cc:action_names.bzl", _ACTION_NAMES = "ACTION_NAMES")

ACTION_NAMES = _ACTION_NAMES
