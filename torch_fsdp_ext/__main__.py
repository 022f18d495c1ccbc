"""Command line of torch_fsdp_ext (also installed as the ``torch-fsdp-ext`` command)."""

from __future__ import annotations

import argparse
import sys

from ._failures import FAILURES, HEADLINE

DESCRIPTION = f"""\
torch_fsdp_ext repairs {HEADLINE}:
{chr(10).join(f"  {name}: {failure}" for name, failure in FAILURES.items())}

To run a training script with the plugin on, without editing it, use the launcher:
  torchrun --nproc-per-node 8 -m torch_fsdp_ext.run train.py ARGS...
  python -m torch_fsdp_ext.run [--fixes dtype,recompute,reduce] [--dtype-strategy upcast|preserve|error] train.py ...
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torch_fsdp_ext", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.epilog = "Set TORCH_FSDP_EXT_DTYPE_STRATEGY=preserve to keep each parameter's loaded dtype."
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    doctor_parser = commands.add_parser(
        "doctor", help="status plus a live 2-rank self-test of each fix"
    )
    doctor_parser.add_argument("--world-size", type=int, default=2, help="ranks for the self-test (default 2)")
    commands.add_parser("status", help="what this torch needs and what is active (no self-test)")
    commands.add_parser(
        "demo", help="a tiny DeepSeek-V3 through accelerate's FSDP2 path on 2 CPU ranks, without and with the plugin"
    )
    export_parser = commands.add_parser(
        "export", help="a DCP training checkpoint's model as safetensors in the dtypes it was loaded in"
    )
    export_parser.add_argument("checkpoint_dir", help="DCP checkpoint with torch_fsdp_ext.save_loaded_dtypes' file")
    export_parser.add_argument("out_dir", help="where model.safetensors is written")
    args = parser.parse_args(argv)
    if args.command == "status":
        import torch_fsdp_ext

        print(torch_fsdp_ext.status())
        return 0
    if args.command == "doctor":
        from ._doctor import doctor

        return doctor(world_size=args.world_size)
    if args.command == "demo":
        from ._demo import demo

        return demo()
    if args.command == "export":
        from ._dtype._loaded_dtypes import ExportError, export

        try:
            print(export(args.checkpoint_dir, args.out_dir))
        except ExportError as e:
            print(f"torch_fsdp_ext export: {e}", file=sys.stderr)
            return 1
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
