"""Reads png_samples' output (and docs/frontier.png) with python's zlib.

An outside decoder for client/chart: chunk CRCs by zlib.crc32, the IDAT
stream by zlib.decompress (which checks the Adler-32), the row filters
undone here, the pixels compared with the canvas's raw bytes; file(1), when
the machine has it, must call each file a PNG of the right size.
Usage: png_zlib_check.py SAMPLE_DIR FRONTIER_PNG
"""
import os
import shutil
import struct
import subprocess
import sys
import zlib


def decode(png):
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "signature"
    at, idat, width, height = 8, b"", None, None
    while at < len(png):
        (n,) = struct.unpack(">I", png[at:at + 4])
        kind, data = png[at + 4:at + 8], png[at + 8:at + 8 + n]
        (crc,) = struct.unpack(">I", png[at + 8 + n:at + 12 + n])
        assert crc == zlib.crc32(kind + data), "CRC of %r" % kind
        if kind == b"IHDR":
            width, height = struct.unpack(">II", data[:8])
            assert data[8:] == b"\x08\x02\x00\x00\x00", "8-bit RGB, no interlace"
        elif kind == b"IDAT":
            idat += data
        at += 12 + n
    raw = zlib.decompress(idat)
    stride = 3 * width
    assert len(raw) == height * (1 + stride), "rows"
    out, prev = bytearray(), bytearray(stride)
    for y in range(height):
        f = raw[y * (1 + stride)]
        row = bytearray(raw[y * (1 + stride) + 1:(y + 1) * (1 + stride)])
        for i in range(stride):
            a = row[i - 3] if i >= 3 else 0
            b = prev[i]
            c = prev[i - 3] if i >= 3 else 0
            if f == 0:
                p = 0
            elif f == 1:
                p = a
            elif f == 2:
                p = b
            elif f == 3:
                p = (a + b) // 2
            elif f == 4:
                q = a + b - c
                pa, pb, pc = abs(q - a), abs(q - b), abs(q - c)
                p = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
            else:
                raise AssertionError("filter type %d in row %d" % (f, y))
            row[i] = (row[i] + p) & 255
        out += row
        prev = row
    return width, height, bytes(out)


def check_file(path, width, height):
    if not shutil.which("file"):
        return
    said = subprocess.run(["file", "-L", "-b", path], capture_output=True, text=True).stdout
    want = "PNG image data, %d x %d, 8-bit/color RGB, non-interlaced" % (width, height)
    assert said.strip() == want, "file(1) says %r" % said


def main():
    sample_dir, frontier = sys.argv[1], sys.argv[2]
    names = sorted(n[:-4] for n in os.listdir(sample_dir) if n.endswith(".png"))
    assert len(names) == 6, names
    for name in names:
        with open(os.path.join(sample_dir, name + ".png"), "rb") as f:
            png = f.read()
        with open(os.path.join(sample_dir, name + ".rgb"), "rb") as f:
            header, rgb = f.read().split(b"\n", 1)
        width, height = map(int, header.split())
        assert decode(png) == (width, height, rgb), name
        check_file(os.path.join(sample_dir, name + ".png"), width, height)
        print("%s: %d x %d, %d bytes of PNG for %d bytes of pixels" % (name, width, height, len(png), len(rgb)))
    with open(os.path.join(sample_dir, "deflate.z"), "rb") as f:
        z = f.read()
    with open(os.path.join(sample_dir, "deflate.bin"), "rb") as f:
        data = f.read()
    assert zlib.decompress(z) == data, "deflate.z"
    print("deflate: %d bytes to %d" % (len(data), len(z)))
    with open(frontier, "rb") as f:
        png = f.read()
    width, height, _ = decode(png)
    assert (width, height) == (960, 600), (width, height)
    check_file(frontier, width, height)
    print("docs/frontier.png: %d x %d, %d bytes" % (width, height, len(png)))


if __name__ == "__main__":
    main()
