"""A stand-in for a library that observes FSDP2 by wrapping ``FSDPParamGroup.__init__`` (for
test/test_foreign_group_init.py). Its own import imports FSDP's package, as such libraries do.

``FSDP_OBSERVER_WRAP``: ``wraps`` (``functools.wraps``), ``plain`` (``def __init__(self, *a, **k)``),
or ``hidden`` (plain, and it reaches the function it wrapped through a dict, where nothing can
follow it). ``FSDP_OBSERVER_AT``: ``import`` (wrap at import) or ``later`` (capture the constructor
at import, put the wrapper in place when ``install()`` is called: it then calls what it captured).
"""

import functools
import os

import torch.distributed.fsdp  # noqa: F401 - imported inside this module's import

FSDPParamGroup = torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup
CALLS = []  # one entry per group the wrapper saw built
_captured = {"init": FSDPParamGroup.__init__}


def install() -> None:
    found = _captured["init"]
    style = os.environ["FSDP_OBSERVER_WRAP"]
    if style == "wraps":
        @functools.wraps(found)
        def __init__(self, *args, **kwargs):
            CALLS.append(type(self).__name__)
            return found(self, *args, **kwargs)
    elif style == "plain":
        def __init__(self, *args, **kwargs):
            CALLS.append(type(self).__name__)
            return found(self, *args, **kwargs)
    else:
        def __init__(self, *args, **kwargs):
            CALLS.append(type(self).__name__)
            return _captured["init"](self, *args, **kwargs)
    FSDPParamGroup.__init__ = __init__


if os.environ["FSDP_OBSERVER_AT"] == "import":
    install()
