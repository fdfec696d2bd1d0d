"""MoE layer forward+backward against the dense SwiGLU limit, a per-expert loop and Tutel (when importable).

    python scripts/bench_moe_layer.py [--quick] [--json FILE] [--png FILE] [--device cuda|cpu]

The same as `moebal bench layer`; see `moebal bench layer --help` for every option.
"""

from __future__ import annotations

import sys

from moebal.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "layer", *sys.argv[1:]]))
