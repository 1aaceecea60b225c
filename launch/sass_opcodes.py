#!/usr/bin/env python3
"""sass_opcodes.py: opcode histograms of sm_90a cubins without cuobjdump (this build machine has none).

The opcode of an sm_90a instruction is in the low 12 bits of its first 64-bit word. OPCODES below was
learned from `cuobjdump --dump-sass` of this project's kernels on an H200 (131 distinct
opcodes, none ambiguous); `learn` rebuilds it from new dumps. Unknown opcodes print as ?xyz.

  python3 launch/sass_opcodes.py hist CUBIN [NAME_FILTER]   counts per kernel
  python3 launch/sass_opcodes.py loop CUBIN NAME_FILTER     opcodes around the HGMMAs
  python3 launch/sass_opcodes.py uniform CUBIN ...          fail if a kernel's k loops copy descriptors
                                                             with R2UR (> 0.5 per HGMMA)
  python3 launch/sass_opcodes.py same OLD.cubin NEW.cubin   fail unless every kernel's SASS is byte-identical
                                                             (a refactor checked without device time); names
                                                             the differing instructions' opcodes
  python3 launch/sass_opcodes.py learn DUMP.sass ...        print a new OPCODES table
  python3 launch/sass_opcodes.py --self-test                 check the parsers on synthetic input

Used to check that the consumers' k loops advance their wgmma descriptors in the uniform datapath
(UIADD3 / UMOV, no R2UR between HGMMAs) before spending device time. Build the
cubin with the project's flags, e.g.
  nvcc -I. -Isrc -Ibuild/generated -O3 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a \
       --expt-relaxed-constexpr -std=c++20 -cubin kernels/sm90/up_kernel.cu -o /tmp/up.cubin
"""
import collections
import re
import struct
import sys

OPCODES = {
    0x207: "SEL", 0x20c: "ISETP", 0x210: "IADD3", 0x211: "LEA", 0x212: "LOP3", 0x213: "IABS",
    0x220: "FMUL", 0x223: "FFMA", 0x224: "IMAD", 0x225: "IMAD", 0x227: "IMAD", 0x23e: "F2FP",
    0x248: "VIMNMX", 0x287: "USEL", 0x28c: "UISETP", 0x290: "UIADD3", 0x291: "ULEA",
    0x292: "ULOP3", 0x2a4: "UIMAD", 0x2a5: "UIMAD", 0x2ca: "R2UR", 0x305: "F2I", 0x306: "I2F",
    0x308: "MUFU", 0x309: "POPC", 0x311: "F2I", 0x312: "I2F", 0x348: "WARPSYNC", 0x387: "STL",
    0x388: "STS", 0x389: "SHFL", 0x3b4: "UTMALDG", 0x3b5: "UTMASTG", 0x3ba: "UBLKCP",
    0x3c6: "FENCE", 0x421: "FADD", 0x424: "IMAD", 0x51d: "BAR", 0x589: "SHFL", 0x5a7: "SYNCS",
    0x5ab: "CGAERRBAR", 0x5b2: "SYNCS", 0x5b4: "UTMALDG", 0x802: "MOV", 0x803: "P2R",
    0x805: "CS2R", 0x806: "VOTE", 0x807: "SEL", 0x80b: "FSETP", 0x80c: "ISETP", 0x810: "IADD3",
    0x811: "LEA", 0x812: "LOP3", 0x816: "PRMT", 0x819: "SHF", 0x81c: "PLOP3", 0x820: "FMUL",
    0x824: "IMAD", 0x825: "IMAD", 0x82d: "PREEXIT", 0x82e: "ACQBULK", 0x82f: "ELECT",
    0x836: "VIADD", 0x844: "STSM", 0x848: "VIMNMX", 0x882: "UMOV", 0x886: "VOTEU", 0x887: "USEL",
    0x88c: "UISETP", 0x890: "UIADD3", 0x891: "ULEA", 0x892: "ULOP3", 0x896: "UPRMT", 0x899: "USHF",
    0x89c: "UPLOP3", 0x8a5: "UIMAD", 0x918: "NOP", 0x919: "S2R", 0x91a: "DEPBAR",
    0x91b: "ENDCOLLECTIVE", 0x941: "BSYNC", 0x942: "BREAK", 0x944: "CALL", 0x945: "BSSY",
    0x946: "YIELD", 0x947: "BRA", 0x948: "WARPSYNC", 0x94d: "EXIT", 0x950: "RET", 0x981: "LDG",
    0x983: "LDL", 0x984: "LDS", 0x985: "ST", 0x986: "STG", 0x988: "STS", 0x989: "SHFL",
    0x98f: "CCTL", 0x992: "MEMBAR", 0x9a6: "REDG", 0x9a7: "SYNCS", 0x9ab: "ERRBAR",
    0x9af: "LDGDEPBAR", 0x9b0: "ARRIVES", 0x9b7: "UTMACMDFLUSH", 0x9b9: "UTMACCTL", 0x9c3: "S2UR",
    0x9c5: "WARPGROUP", 0x9c7: "UCGABAR_ARV", 0x9c8: "USETMAXREG", 0x9f0: "HGMMA", 0x9f3: "QGMMA", 0xab9: "ULDC",
    0xb1d: "BAR", 0xb82: "LDC", 0xc07: "SEL", 0xc0c: "ISETP", 0xc10: "IADD3", 0xc11: "LEA",
    0xc12: "LOP3", 0xc13: "IABS", 0xc20: "FMUL", 0xc24: "IMAD", 0xc25: "IMAD", 0xc36: "VIADD",
    0xc45: "I2FP", 0xc82: "UMOV", 0xd06: "I2F", 0xd12: "I2F", 0xdc7: "UCGABAR_WAIT", 0xe24: "IMAD",
    0xf89: "SHFL", 0xfae: "LDGSTS",
}


def text_sections(path):
    d = open(path, "rb").read()
    if d[:4] != b"\x7fELF" or d[4] != 2:
        raise SystemExit(f"{path}: not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", d, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", d, 0x3A)
    sh = [struct.unpack_from("<IIQQQQIIQQ", d, shoff + i * shentsize) for i in range(shnum)]
    names = sh[shstrndx][4]
    for s in sh:
        name = d[names + s[0]:d.index(b"\0", names + s[0])].decode()
        if name.startswith(".text."):
            yield name[6:], d[s[4]:s[4] + s[5]]


def opcodes(data):
    return [OPCODES.get(w & 0xFFF, "?%03x" % (w & 0xFFF))
            for w in (struct.unpack_from("<Q", data, i)[0] for i in range(0, len(data), 16))]


def learn(lines):
    """{opcode bits: mnemonic} from cuobjdump --dump-sass lines; an opcode seen with two names raises."""
    tab = collections.defaultdict(collections.Counter)
    pat = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);\s+/\* 0x([0-9a-f]{16}) \*/")
    for line in lines:
        m = pat.match(line)
        if m:
            ins = re.sub(r"^@!?U?P\w+\s+", "", m.group(1).strip())
            tab[int(m.group(2), 16) & 0xFFF][(ins.split() or ["NOP"])[0].split(".")[0]] += 1
    clash = {k: dict(v) for k, v in tab.items() if len(v) > 1}
    if clash:
        raise ValueError(f"ambiguous opcodes: {clash}")
    return {k: v.most_common(1)[0][0] for k, v in sorted(tab.items())}


def descriptor_copies(ops):
    """(HGMMAs, R2URs in their issue windows). A window is a run of HGMMAs at most 16 instructions
    apart, from the WARPGROUP (arrive) before its first one (or 12 instructions before it) to its last:
    where descriptors built in vector registers are copied to uniform ones, ~4 R2UR per HGMMA."""
    at = [i for i, o in enumerate(ops) if o in ("HGMMA", "QGMMA")]
    copies, g = 0, 0
    while g < len(at):
        h = g
        while h + 1 < len(at) and at[h + 1] - at[h] <= 16:
            h += 1
        start = max(0, at[g] - 12)
        for i in range(at[g] - 1, max(-1, at[g] - 40), -1):
            if ops[i] == "WARPGROUP":
                start = min(start, i)
                break
        copies += ops[start:at[h]].count("R2UR")
        g = h + 1
    return len(at), copies


def uniform_check(paths, limit=0.5, quiet=False):
    """True when every kernel with HGMMAs in these cubins copies at most `limit` R2UR per HGMMA."""
    ok, seen = True, 0
    for path in paths:
        for name, data in text_sections(path):
            n, copies = descriptor_copies(opcodes(data))
            if n == 0:
                continue
            seen += 1
            bad = copies > limit * n
            ok &= not bad
            if not quiet:
                print(f"{'FAIL' if bad else 'ok  '} {copies:4d} R2UR / {n:3d} HGMMA  {name[:90]}")
    if seen == 0:
        print("no kernel with HGMMA found")
    return ok and seen > 0


def same_sass(old, new, quiet=False):
    """Every kernel of old and new has the same .text bytes; prints one line per kernel (and up to 8
    differing instructions' index and opcodes, old -> new)."""
    a, b = dict(text_sections(old)), dict(text_sections(new))
    ok = True
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            ok = False
            quiet or print(f"only in {'new' if name in b else 'old'}: {name[:100]}")
            continue
        x, y = a[name], b[name]
        diff = [i for i in range(0, min(len(x), len(y)), 16) if x[i:i + 16] != y[i:i + 16]]
        if not diff and len(x) == len(y):
            quiet or print(f"same  {len(x) // 16:6d} instructions  {name[:100]}")
            continue
        ok = False
        if not quiet:
            print(f"DIFF  {len(x) // 16} -> {len(y) // 16} instructions, {len(diff)} differ  {name[:100]}")
            for i in diff[:8]:
                print(f"      #{i // 16}: {opcodes(x[i:i + 16])[0]} -> {opcodes(y[i:i + 16])[0]}")
    return ok


def tiny_cubin(path, words):
    """A minimal ELF64 with one section .text.k holding one 16-byte instruction per 64-bit low word."""
    text = b"".join(struct.pack("<QQ", w, 0) for w in words)
    names = b"\0.shstrtab\0.text.k\0"
    body = text + names
    shoff = 64 + len(body)
    hdr = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9) + struct.pack("<HHIQQQIHHHHHH", 1, 190, 1, 0, 0, shoff, 0,
                                                                64, 0, 0, 64, 3, 1)
    sec = [struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
           struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, 64 + len(text), len(names), 0, 0, 1, 0),
           struct.pack("<IIQQQQIIQQ", 11, 1, 6, 0, 64, len(text), 0, 0, 128, 0)]
    open(path, "wb").write(hdr + body + b"".join(sec))


def self_test():
    import os
    import tempfile
    dump = ["        /*4510*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR28], R24 ;"
            "              /* 0x03e000001c1879f0 */",
            "        /*00f0*/                   R2UR UR16, R3 ;                                   "
            "            /* 0x00000000031072ca */",
            "        /*0100*/               @!P0 R2UR UR17, R2 ;                                  "
            "            /* 0x00000000021172ca */"]
    assert learn(dump) == {0x2CA: "R2UR", 0x9F0: "HGMMA"}, learn(dump)
    try:
        learn(dump + ["        /*0110*/                   IMAD R1, R2, R3, R4 ;                "
                      "            /* 0x00000000031072ca */"])
        raise AssertionError("an ambiguous opcode was accepted")
    except ValueError:
        pass
    assert OPCODES[0x9F0] == "HGMMA" and OPCODES[0x2CA] == "R2UR"
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.cubin")
        tiny_cubin(p, [0x00000000031072CA, 0x03E000001C1879F0, 0x00000000031072CA, 0xFFF])
        (name, data), = text_sections(p)
        assert name == "k" and opcodes(data) == ["R2UR", "HGMMA", "R2UR", "?fff"], opcodes(data)
        hg, r2 = 0x03E000001C1879F0, 0x00000000031072CA
        tiny_cubin(p, [r2, r2, hg, r2, r2, hg])  # descriptors copied before each HGMMA: fails
        assert descriptor_copies(opcodes(next(text_sections(p))[1])) == (2, 4)
        assert not uniform_check([p], quiet=True)
        tiny_cubin(p, [r2, 0xFFF] + [0xFFF] * 12 + [hg, 0xFFF, hg])  # an R2UR far before the loop: passes
        assert uniform_check([p], quiet=True)
        q = os.path.join(d, "q.cubin")
        tiny_cubin(q, [r2, 0xFFF] + [0xFFF] * 12 + [hg, 0xFFF, hg])
        assert same_sass(p, q, quiet=True)
        tiny_cubin(q, [r2, 0xFFF] + [0xFFF] * 12 + [hg, 0xFFF, r2])  # one instruction changed
        assert not same_sass(p, q, quiet=True)
        tiny_cubin(q, [r2, 0xFFF] + [0xFFF] * 12 + [hg, 0xFFF])  # one instruction fewer
        assert not same_sass(p, q, quiet=True)
    print("sass_opcodes self-test: OK")


def main(argv):
    if len(argv) == 2 and argv[1] == "--self-test":
        self_test()
        return
    if len(argv) < 3:
        raise SystemExit(__doc__)
    mode = argv[1]
    if mode == "same":
        if len(argv) != 4:
            raise SystemExit(__doc__)
        sys.exit(0 if same_sass(argv[2], argv[3]) else 1)
    if mode == "uniform":
        sys.exit(0 if uniform_check(argv[2:]) else 1)
    if mode == "learn":
        lines = [line for path in argv[2:] for line in open(path)]
        try:
            print("OPCODES = {\n" + "".join(f'    0x{k:03x}: "{v}",\n' for k, v in learn(lines).items()) + "}")
        except ValueError as e:
            raise SystemExit(str(e))
        return
    filt = argv[3] if len(argv) > 3 else ""
    for name, data in text_sections(argv[2]):
        if filt not in name:
            continue
        ops = opcodes(data)
        if mode == "hist":
            c = collections.Counter(ops)
            keys = ["HGMMA", "QGMMA", "R2UR", "UIADD3", "UMOV", "IMAD", "VIADD", "BRA", "SYNCS"]
            print(name[:80], len(ops), " ".join(f"{k}={c[k]}" for k in keys))
        elif mode == "loop":
            at = [i for i, o in enumerate(ops) if o in ("HGMMA", "QGMMA")]
            if at:
                print(name[:80])
                print(" ".join(ops[max(0, at[0] - 40):at[-1] + 20]))
        else:
            raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
