"""Command line: ``python -m models --list`` prints every preset with its analytic parameter count."""

from __future__ import annotations

import argparse
import sys

from models import MOE_PRESETS, PRESETS
from models.config import human_count


def format_table() -> str:
    """One row per preset: name, family, hidden, layers, heads, kv heads, ffn, parameters."""
    header = ("name", "family", "hidden", "layers", "heads", "kv_heads", "ffn", "params")
    rows = [header] + [
        (c.name, c.family, str(c.hidden_size), str(c.num_layers), str(c.num_heads), str(c.num_kv_heads),
         str(c.ffn_size), human_count(c.num_params()))
        for c in PRESETS.values()
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    # Text columns (name, family) left-aligned, numbers right-aligned.
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def format_moe_table() -> str:
    """The Mixture-of-Experts presets (`models.MOE_PRESETS`): experts, top-k, total and active parameters."""
    header = ("MoE preset (not tuned yet)", "hidden", "layers", "experts", "top_k", "expert ffn", "params", "active")
    rows = [header]
    for c in MOE_PRESETS.values():
        moe = c.moe
        assert moe is not None
        inactive = moe.moe_layers(c.num_layers) * (moe.mlp_params(c.hidden_size) - moe.active_mlp_params(c.hidden_size))
        rows.append((c.name, str(c.hidden_size), str(c.num_layers), str(moe.num_experts), str(moe.top_k),
                     str(moe.expert_ffn_size), human_count(c.num_params()), human_count(c.num_params() - inactive)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m models``."""
    parser = argparse.ArgumentParser(prog="python -m models", description="mistjax model zoo presets.")
    parser.add_argument("--list", action="store_true", help="print a table of every preset and exit")
    args = parser.parse_args(argv)
    if not args.list:
        parser.print_help()
        return 0
    print(format_table())
    print()
    print(format_moe_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
