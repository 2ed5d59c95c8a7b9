"""nvcc_library: a .cu file compiled by nvcc into a static library (or by g++ for the emulation).

Bazel 4's C++ rules cannot compile .cu files, so nvcc runs in a genrule
(machine code for sm_80 (A100) and sm_90 (H100/H200), plus compute_90 PTX so
a newer GPU can JIT the kernels instead of failing with "no kernel image";
-fPIC because tests link dynamically), cc_import wraps the archive, and a
cc_library exposes it with its header and the CUDA runtime. Every target is
`manual`: only --config=cuda builds reach them, through select(//:cuda).

--fmad=false: nvcc never contracts a*b+c into an FMA on its own, as GCC does
not for the CPU twins (-ffp-contract=off in .bazelrc). An FMA only appears
where the source asks for one (fmaf, __fmaf_rn) or inside a libdevice
function (expf, logf). `<name>_ptx` is the same file as PTX text, which
tools/check-fma reads to check that rule (no cuobjdump in the toolkit here).
"""

# The flags every nvcc call shares (the archive and the PTX check). Warnings
# are errors: a comma of template arguments (TcSmem<D, 2>::kForward) in
# PLATEAU_KERNEL_LAUNCH's shared-memory argument shifts the stream into a
# comma expression and launches on the legacy default stream, and nvcc's
# only sign of it is a warning ("expression has no effect").
_NVCC_COMMON = "-O3 -std=c++17 --fmad=false -Werror all-warnings -I."

# sm_80 and sm_90 machine code, and compute_90 PTX a newer GPU can JIT.
_GENCODE_DEFAULT = [
    "-gencode arch=compute_80,code=sm_80",
    "-gencode arch=compute_90,code=[sm_90,compute_90]",
]

# Hopper's own instructions (wgmma): sm_90a code, which runs on sm_90
# devices only (the "a" features do not carry to later GPUs, so no PTX).
GENCODE_SM90A = ["-gencode arch=compute_90a,code=sm_90a"]

def nvcc_library(name, src, hdr, textual_hdrs = [], gencode = _GENCODE_DEFAULT, deps = []):
    archive = "lib%s.a" % name
    native.genrule(
        name = name + "_nvcc",
        srcs = [src, hdr] + textual_hdrs,
        outs = [archive],
        # nvcc finds its compilers (cicc, ptxas, fatbinary) and headers
        # relative to its real location, not the symlink Bazel stages.
        cmd = " ".join([
            "$$(readlink -f $(location @cuda//:nvcc))",
            _NVCC_COMMON,
            "-Xcompiler -fPIC",
        ] + gencode + [
            "-lib -o $@",
            "$(location %s)" % src,
        ]),
        message = "nvcc " + native.package_name() + "/" + src,
        tags = ["manual"],
        tools = ["@cuda//:nvcc"],
    )
    native.genrule(
        name = name + "_ptx",
        srcs = [src, hdr] + textual_hdrs,
        outs = [name + ".ptx"],
        cmd = " ".join([
            "$$(readlink -f $(location @cuda//:nvcc))",
            _NVCC_COMMON,
            "-arch=%s -ptx -o $@" % ("compute_90a" if gencode == GENCODE_SM90A else "compute_90"),
            "$(location %s)" % src,
        ]),
        message = "nvcc -ptx " + native.package_name() + "/" + src,
        tags = ["manual"],
        tools = ["@cuda//:nvcc"],
        visibility = ["//tools:__pkg__"],
    )
    native.cc_import(
        name = name + "_archive",
        static_library = ":" + archive,
        tags = ["manual"],
    )
    # Under --config=cuda_emulated, g++ compiles the same file as C++ against
    # the emulation's headers (kernels/cuda/emulated/) instead.
    native.genrule(
        name = name + "_emulated_cc",
        srcs = [src],
        outs = [name + "_emulated.cc"],
        cmd = "echo '#include \"%s/%s\"' > $@" % (native.package_name(), src),
        tags = ["manual"],
    )
    native.cc_library(
        name = name + "_emulated",
        srcs = [":" + name + "_emulated.cc"],
        textual_hdrs = [src, hdr] + textual_hdrs,
        # The kernels' #pragma unroll, and CUDA's unsigned threadIdx against
        # int counts, mean nothing to g++.
        copts = ["-Wno-unknown-pragmas", "-Wno-sign-compare"],
        tags = ["manual"],
        deps = ["//kernels/cuda:simt_emulator"],
    )
    native.cc_library(
        name = name,
        hdrs = [hdr],
        tags = ["manual"],
        # `deps`: other nvcc_libraries whose host functions this one calls
        # (so the linker sees their archives after this one's).
        deps = select({
            "//:cuda_emulated": [":" + name + "_emulated"],
            "//conditions:default": [":" + name + "_archive"],
        }) + deps + ["//kernels/cuda:cudart"],
    )
