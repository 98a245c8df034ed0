"""Regenerate the adaptermesh.v1 Python modules with grpcio-tools.

``python -m adaptermesh.proto.generate`` rewrites the modules beside the .proto files;
``generate(out_dir)`` writes them elsewhere, which the staleness test uses.

The .proto files import each other as ``adaptermesh/v1/...``, the path other languages use.
The generated Python imports are rewritten to the package's real location,
``adaptermesh.proto.adaptermesh.v1``.

Protos of a public package that other libraries also ship (``inference``, the KServe v2
protocol, which tritonclient registers too) are built into a private descriptor pool, so a
process that imports both does not fail on duplicate symbols.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

__all__ = ["DESCRIPTOR_SET", "PROTO_ROOT", "generate", "main"]

PROTO_ROOT = Path(str(resources.files("adaptermesh.proto")))
_PKG_DIR = Path("adaptermesh") / "v1"
DESCRIPTOR_SET = "open_inference.desc"
_IMPORT_RE = re.compile(r"^from adaptermesh\.v1 import", re.MULTILINE)
# Generated modules whose descriptors go into their own pool rather than the default one.
_PRIVATE_POOL = frozenset({"open_inference_pb2.py"})
_DEFAULT_POOL = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
_OWN_POOL = (
    "# A private pool: other libraries register the same public package in the default one.\n"
    "POOL = _descriptor_pool.DescriptorPool()\n"
    "DESCRIPTOR = POOL.AddSerializedFile("
)


def generate(out_dir: Path) -> list[Path]:
    """Generate *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every .proto into out_dir."""
    from grpc_tools import protoc  # dev dependency; imported lazily

    protos = sorted((PROTO_ROOT / _PKG_DIR).glob("*.proto"))
    include = Path(str(resources.files("grpc_tools"))) / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(p.relative_to(PROTO_ROOT)) for p in protos),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed: " + " ".join(args))
        # The KServe v2 service's descriptor set, for Envoy's gRPC-JSON transcoder
        # (mesh/transcoder.py adds each grpc-json AdapterInstance path to it).
        desc = Path(tmp) / _PKG_DIR / DESCRIPTOR_SET
        v2 = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            "--include_imports",
            f"--descriptor_set_out={desc}",
            str(_PKG_DIR / "open_inference.proto"),
        ]
        if protoc.main(v2) != 0:
            raise RuntimeError("protoc failed: " + " ".join(v2))
        written = []
        for src in sorted((Path(tmp) / _PKG_DIR).iterdir()):
            if src.name == DESCRIPTOR_SET:
                (out_dir / src.name).write_bytes(src.read_bytes())
                written.append(out_dir / src.name)
                continue
            text = _IMPORT_RE.sub("from adaptermesh.proto.adaptermesh.v1 import", src.read_text())
            if src.name in _PRIVATE_POOL:
                if _DEFAULT_POOL not in text:
                    raise RuntimeError(f"{src.name}: no default-pool registration to replace")
                text = text.replace(_DEFAULT_POOL, _OWN_POOL)
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
    return written


def main() -> None:
    out = PROTO_ROOT / _PKG_DIR
    for path in generate(out):
        print(f"wrote {path}", file=sys.stderr)
    shutil.rmtree(out / "__pycache__", ignore_errors=True)


if __name__ == "__main__":
    main()
