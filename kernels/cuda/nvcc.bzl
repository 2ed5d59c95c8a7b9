"""nvcc_library: a .cu file compiled by nvcc into a static library.

Bazel 4's C++ rules cannot compile .cu files, so nvcc runs in a genrule
(machine code for sm_80 (A100) and sm_90 (H100/H200); -fPIC because tests link
dynamically), cc_import wraps the archive, and a cc_library exposes it with
its header and the CUDA runtime. Every target is `manual`: only
--config=cuda builds reach them, through select(//:cuda).
"""

def nvcc_library(name, src, hdr, textual_hdrs = []):
    archive = "lib%s.a" % name
    native.genrule(
        name = name + "_nvcc",
        srcs = [src, hdr] + textual_hdrs,
        outs = [archive],
        # nvcc finds its compilers (cicc, ptxas, fatbinary) and headers
        # relative to its real location, not the symlink Bazel stages.
        cmd = " ".join([
            "$$(readlink -f $(location @cuda//:nvcc))",
            "-O3 -std=c++17 -Xcompiler -fPIC",
            "-gencode arch=compute_80,code=sm_80",
            "-gencode arch=compute_90,code=sm_90",
            "-I.",
            "-lib -o $@",
            "$(location %s)" % src,
        ]),
        message = "nvcc " + native.package_name() + "/" + src,
        tags = ["manual"],
        tools = ["@cuda//:nvcc"],
    )
    native.cc_import(
        name = name + "_archive",
        static_library = ":" + archive,
        tags = ["manual"],
    )
    native.cc_library(
        name = name,
        hdrs = [hdr],
        tags = ["manual"],
        deps = [
            ":" + name + "_archive",
            "@cuda//:cudart",
        ],
    )
