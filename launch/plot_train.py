#!/usr/bin/env python3
"""Plot epmoe_train's JSON log (--json PATH): loss vs step and step time vs step, one PNG.

  python3 launch/plot_train.py TRAIN.json [--png OUT.png]   default OUT: TRAIN.json's name with .png
  python3 launch/plot_train.py --self-test                  a tiny synthetic log, plotted to a temp dir

The log (src/programs/train_loop.cpp, write_json_log): "config" (shape, world, backend, optimizer),
"log" [{step, loss, ms, data_ms, tokens_per_s, tflops, peak_bytes}, ...] (rank 0's logged steps; ms is
the training step's mean since the previous entry, data_ms the data + teacher target apart) and
"summary". Exit status: 0 plotted, 1 bad input, 77 matplotlib does not import (ctest: skipped).
"""
import argparse
import json
import os
import sys
import tempfile

SKIP = 77


def load(path):
    """The log's config and its entries sorted by step; ValueError when it is not a training log."""
    with open(path) as f:
        doc = json.load(f)
    if doc.get("program") != "epmoe_train" or not isinstance(doc.get("log"), list):
        raise ValueError(f"{path}: not an epmoe_train JSON log")
    rows = sorted(doc["log"], key=lambda r: r["step"])
    for r in rows:
        for key in ("step", "loss", "ms"):
            if key not in r:
                raise ValueError(f"{path}: a log entry without '{key}': {r}")
    if not rows:
        raise ValueError(f"{path}: the log has no entries")
    return doc.get("config", {}), rows


def title_of(cfg):
    keys = [("world", "world"), ("experts", "E"), ("topk", "k"), ("hidden", "hidden"), ("ffn", "ffn"),
            ("tokens_per_rank", "T/rank")]
    shape = " ".join(f"{label}={cfg[k]}" for k, label in keys if k in cfg)
    return f"epmoe_train: {cfg.get('backend', '?')}, {shape}"


def plot(cfg, rows, png):
    """Writes the PNG; False (and a message) when matplotlib does not import."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"# matplotlib not importable ({e}): no plot")
        return False
    steps = [r["step"] for r in rows]
    fig, (ax_loss, ax_ms) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [r["loss"] for r in rows], marker="o", markersize=3)
    if all(r["loss"] > 0 for r in rows):
        ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (MSE to the teacher, mean over ranks)")
    ax_loss.grid(True, which="both", alpha=0.3)
    ax_ms.plot(steps, [r["ms"] for r in rows], marker="o", markersize=3, label="training step")
    if all("data_ms" in r for r in rows):
        ax_ms.plot(steps, [r["data_ms"] for r in rows], marker=".", markersize=3, label="data + teacher")
    ax_ms.set_xlabel("step")
    ax_ms.set_ylabel("ms per step (mean since the previous point)")
    ax_ms.set_ylim(bottom=0)
    ax_ms.grid(True, alpha=0.3)
    ax_ms.legend()
    fig.suptitle(title_of(cfg), fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


def self_test():
    """A synthetic log through load() and plot(); the PNG must exist and be a PNG."""
    rows = [{"step": s, "loss": 0.5 * 0.97 ** s, "ms": 200.0 + (s % 3), "data_ms": 60.0, "tokens_per_s": 1e4,
             "tflops": 0.003, "peak_bytes": 2 ** 28} for s in (1, 10, 20, 30)]
    doc = {"program": "epmoe_train",
           "config": {"backend": "mock ranks on CPU", "world": 4, "experts": 16, "topk": 2, "hidden": 256,
                      "ffn": 128, "tokens_per_rank": 512},
           "log": list(reversed(rows)), "summary": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "train.json")
        with open(path, "w") as f:
            json.dump(doc, f)
        cfg, got = load(path)
        assert [r["step"] for r in got] == [1, 10, 20, 30], got
        assert "E=16" in title_of(cfg), title_of(cfg)
        bad = os.path.join(tmp, "bad.json")
        with open(bad, "w") as f:
            json.dump({"program": "something else", "log": []}, f)
        try:
            load(bad)
            raise AssertionError("a foreign JSON was accepted")
        except ValueError:
            pass
        png = os.path.join(tmp, "train.png")
        if not plot(cfg, got, png):
            print("plot_train self-test: parser OK, plot skipped (no matplotlib)")
            return SKIP
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", "not a PNG"
    print("plot_train self-test: OK")
    return 0


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="epmoe_train's --json log")
    ap.add_argument("--png", help="output PNG (default: the JSON's path with .png)")
    args = ap.parse_args(argv[1:])
    try:
        cfg, rows = load(args.json)
    except (OSError, ValueError) as e:
        print(f"plot_train: {e}", file=sys.stderr)
        return 1
    png = args.png or os.path.splitext(args.json)[0] + ".png"
    if not plot(cfg, rows, png):
        return SKIP
    print(f"# wrote {png}: loss {rows[0]['loss']:.4g} (step {rows[0]['step']}) -> {rows[-1]['loss']:.4g} "
          f"(step {rows[-1]['step']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
