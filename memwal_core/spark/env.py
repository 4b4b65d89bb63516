"""What a Spark executor needs to run memwal's tasks: a Python with pylance, and memwal_core.

The tasks are functions of `memwal_core.spark.tasks` (pickled by reference) that import lance,
pyarrow and memwal_core in the executor's Python workers. On `local[*]` those workers are
children of this process's JVM and inherit its interpreter and paths. On a cluster they are
not, so for every non-local, non-Connect master the driver:

- chooses the executors' interpreter (`executor_python`): `spark.pyspark.python` if
  configured, else the packed environment shipped with `spark.archives` (`#alias` ->
  `./alias/bin/python`), else `PYSPARK_PYTHON`, else **this** interpreter (right when the
  executors run on this machine, or the same path exists on every node). pyspark reads the
  choice from `PYSPARK_PYTHON` when the SparkContext starts (an in-process session ignores
  the `spark.pyspark.python` setting otherwise), so it is set there too;
- ships memwal_core itself with the job (`package_zip`, added with `addPyFile`): workers put
  it ahead of site-packages, so the executors run exactly the driver's memwal code (the tasks
  and their pickled `ReadConfig` refer to it by name; another installed version on a node, an
  editable checkout elsewhere, or none at all cannot change what a task does). The environment
  on the executors therefore needs only memwal's dependencies, not memwal.

`pack_environment` builds the `spark.archives` file for remote executors (`memwal spark-env`).
It is written here rather than taken from venv-pack (0.2.0, the last release, 2018), which was
tried on this project's own virtualenv and does not do the job as Spark 4 needs it: it stores
`bin/python3.X` as a symlink to the base interpreter's absolute path, an entry pointing outside
the archive (stored here as a copy of its target); it packs the editable-install hooks of
`pip install -e` (its check looks only for `.pth` lines naming a directory, not for the
`__editable__` finders pip writes today) and every `__pycache__`; and it writes `.tar` and
`.zip` too, whose Spark unpacking drops the executable bits (refused here). conda-pack packs
conda environments only.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Iterable
from urllib.parse import urlparse


def is_cluster(master: str) -> bool:
    """A master whose executors are not this process's children (and not Spark Connect)."""
    return not (master.startswith("local") or master.startswith("sc://"))


def loopback_master(master: str) -> bool:
    """`spark://127.0.0.1:P` / `spark://localhost:P`: the cluster runs on this machine, so the
    driver can listen on loopback too."""
    if not master.startswith("spark://"):
        return False
    hosts = [urlparse(f"spark://{h}").hostname for h in master[len("spark://"):].split(",")]
    return all(h in ("127.0.0.1", "localhost", "::1") for h in hosts)


def archive_python(archives: str) -> str | None:
    """`./alias/bin/python` for the first `spark.archives` entry with a `#alias`."""
    for entry in filter(None, (a.strip() for a in archives.split(","))):
        if "#" in entry:
            return f"./{entry.rsplit('#', 1)[1]}/bin/python"
    return None


def executor_python(conf: dict[str, str]) -> str:
    return (conf.get("spark.pyspark.python") or archive_python(conf.get("spark.archives", ""))
            or os.environ.get("PYSPARK_PYTHON") or sys.executable)


def package_zip(cache_dir: str | os.PathLike | None = None) -> Path:
    """memwal_core (its .py files) as a zip named by its content hash; built once per content."""
    pkg = Path(__file__).resolve().parent.parent  # memwal_core/
    files = sorted(p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts)
    digest = hashlib.sha256()
    for p in files:
        digest.update(str(p.relative_to(pkg)).encode() + b"\0" + p.read_bytes() + b"\0")
    out_dir = Path(cache_dir or os.path.join(tempfile.gettempdir(), f"memwal-pyfiles-{os.getuid()}"))
    out = out_dir / f"memwal_core-{digest.hexdigest()[:16]}.zip"
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for p in files:
            # Fixed timestamps: the same code gives the same bytes.
            info = zipfile.ZipInfo(str(Path("memwal_core") / p.relative_to(pkg)), (2020, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, p.read_bytes())
    os.replace(tmp, out)  # concurrent builders write the same bytes
    return out


def prepare(master: str, conf: dict[str, str]) -> None:
    """Before the session starts (cluster masters only): the executors' Python, and loopback
    for a cluster on this machine. Mutates `conf` and this process's environment."""
    if loopback_master(master):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    python = executor_python(conf)
    conf["spark.pyspark.python"] = python
    os.environ["PYSPARK_PYTHON"] = python  # what pyspark's SparkContext actually reads


def ship_package(session) -> None:
    """After the session starts: memwal_core to every executor (a no-op if already added)."""
    sc = session.sparkContext
    path = str(package_zip())
    if os.path.basename(path) not in (getattr(sc, "_python_includes", None) or []):
        sc.addPyFile(path)


# ------------------------------------------------------------------------------ packed env

def editable_files(prefix: str | os.PathLike = sys.prefix) -> list[str]:
    """A virtualenv's editable-install hooks (`pip install -e`: `__editable__*` files, old
    `.egg-link`s), relative to it: they point at a source checkout the nodes do not have, and
    the executors get memwal_core with the job anyway."""
    return sorted(str(p.relative_to(prefix)) for site in Path(prefix).glob("lib/python*/site-packages")
                  for p in site.iterdir() if p.name.startswith("__editable__") or p.name.endswith(".egg-link"))


def pack_environment(output: str | os.PathLike, prefix: str | os.PathLike = sys.prefix, *,
                     exclude: Iterable[str] = (), force: bool = False) -> tuple[Path, list[str]]:
    """A virtualenv as a `spark.archives` file (`.tar.gz`): its files minus editable-install
    hooks, `__pycache__` and paths matching an `exclude` pattern (fnmatch on the path inside the
    env, `*` spans `/`: `lib/python3.11/site-packages/dagster*`). Returns (archive, the editable
    files left out).

    `.tar.gz` only: Spark 4 unpacks it with the system `tar`, keeping executable bits, while a
    `.tar` or `.zip` goes through Java code that drops them (the executors' `bin/python` would
    not run). Symlinks that leave the env (a venv's `bin/python3.X` -> the base interpreter)
    are stored as copies of their target, the layout `python -m venv --copies` makes, so the
    archive has no entry pointing outside it; inside symlinks stay, made relative. The base
    interpreter's standard library is not packed: the nodes need the same Python at the same
    path as the env's `pyvenv.cfg` `home` (or ship a conda-pack archive, which holds it).
    """
    prefix = Path(prefix).absolute()
    output = Path(output).absolute()
    if output.exists() and not force:
        raise FileExistsError(f"{output} exists (--force overwrites)")
    if not (prefix / "pyvenv.cfg").is_file():
        raise ValueError(f"{prefix} is not a virtualenv (no pyvenv.cfg)")
    skip = editable_files(prefix)
    patterns = [*skip, *exclude]
    if not output.name.endswith((".tar.gz", ".tgz")):
        raise ValueError(f"{output.name}: the archive must be a .tar.gz or .tgz (Spark keeps executable bits "
                         "only for those)")
    tmp = output.with_name(output.name + ".partial")
    with tarfile.open(tmp, "w:gz", compresslevel=1) as tar:
        for root, dirs, files in os.walk(prefix):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files) + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
                path = Path(root) / name
                rel = str(path.relative_to(prefix))
                if path == tmp or any(fnmatch.fnmatch(rel, p) for p in patterns):
                    continue
                _add(tar, path, rel, prefix)
    os.replace(tmp, output)
    return output, skip


def _add(tar: tarfile.TarFile, path: Path, rel: str, prefix: Path) -> None:
    if not path.is_symlink():
        tar.add(path, rel, recursive=False)
        return
    target = path.resolve()
    if target.is_relative_to(prefix.resolve()):
        info = tarfile.TarInfo(rel)
        info.type, info.linkname = tarfile.SYMTYPE, os.path.relpath(target, path.parent.resolve())
        tar.addfile(info)
    elif target.is_file():
        tar.add(target, rel, recursive=False)  # dereferenced: a copy, keeping the mode
    else:
        raise ValueError(f"{path} links outside the virtualenv to {target}, which is not a file")
