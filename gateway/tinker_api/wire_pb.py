"""The Tinker SDK's generated protobuf module (``tinker_public_pb2``), loaded without the SDK.

Importing ``tinker.proto.tinker_public_pb2`` runs the SDK package's ``__init__``, which imports
torch when it is installed (tinker/types/tensor_data.py), and the gateway stays torch-free
(tests/unit/test_import_contracts.py). The generated module itself needs only protobuf, so we
load the same file by path. protobuf keeps one descriptor per proto file, so when the SDK is
imported as well (tests, the e2e client) both names give the very same message classes.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING

_NAME = "gateway.tinker_api._tinker_public_pb2"


def _load():
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    tinker = importlib.util.find_spec("tinker")  # finds the package without running it
    if tinker is None or not tinker.submodule_search_locations:
        raise ImportError("the tinker SDK (its wire types) is not installed")
    path = Path(next(iter(tinker.submodule_search_locations))) / "proto" / "tinker_public_pb2.py"
    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    spec.loader.exec_module(module)
    return module


if TYPE_CHECKING:  # the type checker reads the SDK's stubs; at run time nothing runs the SDK
    from tinker.proto import tinker_public_pb2 as pb
else:
    pb = _load()
