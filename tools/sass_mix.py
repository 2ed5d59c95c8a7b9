#!/usr/bin/env python3
"""Instruction mix of each kernel's main loop, from nvdisasm's SASS listing.

Usage: sass_mix.py LISTING.sass, or sass_mix.py --old-abi-header FILE.cubin
(tools/sass-mix runs both).

The main loop of a kernel is the backward branch's range holding the most
HMMA (tensor-core) instructions. Its common path leaves out the ranges that
only boundary tiles run, found as the ranges a forward branch skips that
hold no HMMA and either set scores to -inf (FSEL ... -INF: a causal or
length mask) or only zero-filling copies (LDGSTS with a predicate operand,
none without). A static count: each instruction once, as listed; what it
says is how many instructions a warp issues per tile beside its HMMAs,
which bounds the loop's speed when the tensor cores wait on issue.
"""
import collections
import re
import struct
import sys

# Tensor-core instructions: mma.sync (HMMA) and wgmma (HGMMA).
MMA = ('HMMA', 'HGMMA')


def parse(kernel_text):
    labels, ins = {}, []
    for line in kernel_text.split('\n'):
        m = re.match(r'^(\.L_x_\d+):', line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r'\s+/\*[0-9a-f]+\*/\s+(.*?)\s*;', line)
        if m:
            body = m.group(1)
            op = re.sub(r'^@!?U?P\w+\s+', '', body).split()[0]
            ins.append((op, body))
    return labels, ins


def target(body, labels):
    m = re.search(r'(\.L_x_\d+)', body)
    return labels.get(m.group(1)) if m else None


def boundary_only(rng):
    ops = [(op, body) for op, body in rng]
    if any(op.startswith(MMA) for op, _ in ops):
        return None
    if any(op.startswith('FSEL') and '-INF' in body for op, body in ops):
        return 'mask'
    copies = [body for op, body in ops if op.startswith('LDGSTS')]
    if copies and all(re.search(r',\s*!?P\d\s*$', b) for b in copies):
        return 'zero-fill copies'
    return None


def old_abi_header(path):
    """Rewrites a cubin's ELF header in place from the ELF ABI version 8 that
    CUDA 12.8+ writes (architecture in e_flags bits 8-15) to version 7 (bits
    0-7 and, as the virtual architecture, 16-23, with the unified-texture
    and 64-bit-address flags), which nvdisasm 11.8 reads; the machine code
    is the same either way."""
    data = bytearray(open(path, 'rb').read())
    if data[8] != 8:
        return
    arch = (struct.unpack_from('<I', data, 48)[0] >> 8) & 0xff
    data[8] = 7
    struct.pack_into('<I', data, 48, (arch << 16) | 0x500 | arch)
    open(path, 'wb').write(data)


def main():
    if sys.argv[1] == '--old-abi-header':
        old_abi_header(sys.argv[2])
        return
    text = open(sys.argv[1]).read()
    print(f"{'kernel':34} {'loop':>5} {'MMA':>5} {'common':>6} {'other/MMA':>10}  "
          "left out; most frequent on the common path")
    for chunk in re.split(r'\n//-+ \.text\.', text)[1:]:
        name = chunk.split(' ')[0]
        m = re.search(r'\d([A-Z]\w*?)I((?:Li\d+E)+)E', name)
        short = name[:34]
        if m:
            short = m.group(1) + '<' + ','.join(re.findall(r'\d+', m.group(2))) + '>'

        labels, ins = parse(chunk)
        best = None
        for i, (op, body) in enumerate(ins):
            t = target(body, labels) if op == 'BRA' else None
            if t is not None and t <= i:
                h = sum(op2.startswith(MMA) for op2, _ in ins[t:i + 1])
                if h and (best is None or h > best[0]):
                    best = (h, t, i)
        if best is None:
            continue
        h, s, e = best
        out = set()
        kinds = collections.Counter()
        for i in range(s, e + 1):
            op, body = ins[i]
            t = target(body, labels) if op == 'BRA' else None
            if t is not None and i < t <= e + 1:
                kind = boundary_only(ins[i + 1:t])
                if kind:
                    new = set(range(i + 1, t)) - out
                    out |= new
                    kinds[kind] += len(new)
        common = [ins[i][0].split('.')[0] for i in range(s, e + 1) if i not in out]
        mix = collections.Counter(common)
        top = ', '.join(f'{o} {n}' for o, n in mix.most_common(8))
        left = ', '.join(f'{k} {n}' for k, n in kinds.items()) or 'none'
        print(f"{short:34} {e - s + 1:5d} {h:5d} {len(common):6d} {(len(common) - h) / h:10.1f}  "
              f"{left}; {top}")


if __name__ == '__main__':
    main()
