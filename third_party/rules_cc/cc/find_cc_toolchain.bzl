"""Forwards find_cc_toolchain to Bazel's built-in C++ toolchain lookup."""

CC_TOOLCHAIN_TYPE = "@bazel_tools//tools/cpp:toolchain_type"

def find_cc_toolchain(ctx):
    if "_cc_toolchain" in dir(ctx.attr):
        return ctx.attr._cc_toolchain[cc_common.CcToolchainInfo]
    return ctx.toolchains[CC_TOOLCHAIN_TYPE]

def find_cpp_toolchain(ctx):
    return find_cc_toolchain(ctx)
