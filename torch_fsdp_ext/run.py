"""Run a training script with torch_fsdp_ext installed, without editing the script.

    torchrun --nproc-per-node 8 -m torch_fsdp_ext.run train.py --lr 1e-4
    accelerate launch -m torch_fsdp_ext.run train.py --lr 1e-4
    python -m torch_fsdp_ext.run [--dtype-strategy STRATEGY] train.py ARGS...
    python -m torch_fsdp_ext.run --fixes reduce train.py ARGS...
    python -m torch_fsdp_ext.run --compute-in-loaded-dtype LlamaRMSNorm,lm_head train.py ARGS...
    python -m torch_fsdp_ext.run --compute-in-loaded-dtype auto train.py ARGS...
    python -m torch_fsdp_ext.run --reduce-dtype float32 train.py ARGS...
    python -m torch_fsdp_ext.run -m package.module ARGS...

Imports the plugin (which installs the fixes this torch needs), then runs the script
as __main__ with sys.argv set to the script and its arguments, as "python train.py
ARGS" would. Options of this launcher come before the script; everything after the
script belongs to it. --fixes installs only the fixes it names (comma-separated, as
TORCH_FSDP_EXT_FIXES). TORCH_FSDP_EXT_DISABLE=1 still turns the import's install off;
--dtype-strategy and --fixes install explicitly.

Processes the script starts itself (torch.multiprocessing.spawn) get the plugin too,
with the same settings: the launcher sets TORCH_FSDP_EXT_AUTOLOAD=1 (and the variables
of its options) for them, which the package's start-up hook (torch_fsdp_ext.pth)
reads in every new interpreter.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    import torch_fsdp_ext
    from torch_fsdp_ext import _env

    parser = argparse.ArgumentParser(
        prog="python -m torch_fsdp_ext.run",
        usage="%(prog)s [--fixes FIXES] [--dtype-strategy STRATEGY] [--compute-in-loaded-dtype MODULES] "
        "[--reduce-dtype float32] (SCRIPT | -m MODULE) [ARGS ...]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--fixes",
        metavar="FIXES",
        help=f"comma-separated fixes to install, of {', '.join(torch_fsdp_ext.FIX_NAMES)} (default: all this torch "
        "needs; as TORCH_FSDP_EXT_FIXES)",
    )
    parser.add_argument(
        "--dtype-strategy",
        choices=torch_fsdp_ext.STRATEGIES,
        type=lambda value: value.strip().lower(),  # as install() and the environment read it
        help="how mixed parameter dtypes in one FSDP group are handled (installs with this strategy)",
    )
    parser.add_argument(
        "--compute-in-loaded-dtype",
        metavar="MODULES",
        help="comma-separated module class names / FQN globs whose parameters compute in their loaded dtype in "
        "every FSDP group, with casts at their boundaries; 'auto': the fp32-loaded modules a transformers model's "
        "_keep_in_fp32_modules(_strict) lists name (as TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE; docs/compute-dtype.md)",
    )
    parser.add_argument(
        "--reduce-dtype",
        choices=("float32",),
        type=lambda value: value.strip().lower(),
        help="accumulate and reduce gradients in fp32 where a fully_shard policy's reduce_dtype is unset or 16-bit "
        "(accelerate's, the HF Trainer's mixed_precision: bf16; as TORCH_FSDP_EXT_REDUCE_DTYPE)",
    )
    parser.add_argument("-m", dest="as_module", action="store_true", help="run a module, like python -m")
    parser.add_argument("target", nargs="?", metavar="SCRIPT", help="the script (or, with -m, the module) to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments")
    options = parser.parse_args(argv)
    if options.target is None:
        parser.error("no script to run: give a script path, or -m and a module name")

    fixes = _env.names("TORCH_FSDP_EXT_FIXES", torch_fsdp_ext.FIX_NAMES)  # as the import read it
    if options.fixes is not None:
        try:
            fixes = _env.parse_names(options.fixes, torch_fsdp_ext.FIX_NAMES, "--fixes")
        except torch_fsdp_ext.SettingError as e:
            parser.error(str(e))
        torch_fsdp_ext.uninstall([name for name in torch_fsdp_ext.FIX_NAMES if name not in fixes])
        os.environ["TORCH_FSDP_EXT_FIXES"] = ",".join(fixes)
    if options.dtype_strategy is not None or options.fixes is not None or options.reduce_dtype is not None:
        setting = {} if options.reduce_dtype is None else {"reduce_dtype": options.reduce_dtype}
        torch_fsdp_ext.install(fixes, dtype_strategy=options.dtype_strategy, **setting)
    if options.dtype_strategy is not None:
        os.environ["TORCH_FSDP_EXT_DTYPE_STRATEGY"] = options.dtype_strategy
    if options.reduce_dtype is not None:
        os.environ["TORCH_FSDP_EXT_REDUCE_DTYPE"] = options.reduce_dtype
    if options.compute_in_loaded_dtype is not None:
        compute_dtype = torch_fsdp_ext._compute_dtype
        compute_dtype.set_default_selectors(options.compute_in_loaded_dtype, compute_dtype.LAUNCHER_OPTION)
        os.environ[compute_dtype.ENV_VAR] = options.compute_in_loaded_dtype
    os.environ["TORCH_FSDP_EXT_AUTOLOAD"] = "1"  # for interpreters the script starts (torch_fsdp_ext_startup)
    sys.argv = [options.target, *options.args]
    if options.as_module:
        runpy.run_module(options.target, run_name="__main__", alter_sys=True)
    else:
        # As ``python train.py`` does: the script's directory first on the import path.
        sys.path[0] = os.path.dirname(os.path.abspath(options.target))
        runpy.run_path(options.target, run_name="__main__")


if __name__ == "__main__":
    main()
