"""The book runner: sync, execute (papermill), render (nbconvert), store outputs, check pairs.

Commands (run from the repository root)::

    python -m k3lab.book run                          # every chapter on the CPU defaults (`make book`)
    python -m k3lab.book run --only 00 01 -p train_steps 50
    python -m k3lab.book run --profile gpu            # parameters from params/h200.yaml
    python -m k3lab.book store 01                     # execute on CPU defaults, keep outputs in book/01_*.ipynb
    python -m k3lab.book check-sync                   # fail if a book/NN_*.py and its .ipynb differ

Every chapter is ``book/NN_name.py`` (jupytext py:percent, the file to edit) paired with
``book/NN_name.ipynb`` (the same cells plus stored CPU outputs, which nbval compares). ``run`` first
copies each ``.py``'s cells into its ``.ipynb`` when they differ (keeping the outputs of cells whose code is unchanged),
then executes the notebook with papermill (kernel ``python3``, working directory ``book/``) into
``build/notebooks/``, renders ``build/html/``, and prints a table (notebook, status, seconds). It exits 1
when any notebook failed, 2 on a usage error (a bad flag, parameter, parameter file or chapter key).

The GPU parameter file maps ``all`` and notebook prefixes (``"01"``) or names (``"01_kda"``) to
parameters; ``-p key value`` overrides them. Only parameters a notebook's ``parameters`` cell
declares are passed to it.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from k3lab.files import atomic_write_text, blocked_parent

ROOT = Path(__file__).resolve().parents[1]
BOOK_DIR = ROOT / "book"
BUILD_DIR = ROOT / "build"
PARAMS = {"gpu": ROOT / "params" / "h200.yaml"}
KERNEL = "python3"
KERNELSPEC = {"name": KERNEL, "display_name": "Python 3 (ipykernel)", "language": "python"}
TEXT_FORMAT = "py:percent"


@dataclass
class Result:
    """One notebook's outcome in a run."""

    name: str
    status: str
    seconds: float
    detail: str = ""


def chapters(only: list[str] | None = None, book_dir: Path = BOOK_DIR) -> list[Path]:
    """The chapter sources ``book/NN_*.py`` in order, optionally filtered.

    Args:
        only (list[str] | None): prefixes such as ``["00", "01"]`` or full names (``"01_kda"``).

    Raises:
        ValueError: an entry of ``only`` matches no chapter.
    """
    paths = sorted(p for p in Path(book_dir).glob("[0-9][0-9]_*.py"))
    if not only:
        return paths
    chosen = []
    for key in only:
        match = [p for p in paths if p.stem == key or p.stem.split("_", 1)[0] == key]
        if not match:
            names = ", ".join(p.stem for p in paths) or "none"
            raise ValueError(f"{key!r} names no chapter in {book_dir} (have: {names})")
        chosen += [p for p in match if p not in chosen]
    return sorted(chosen)


def _cells(nb) -> list[tuple[str, str, tuple[str, ...]]]:
    """What a pair must agree on: each cell's type, source and tags."""
    return [(c.cell_type, c.source.strip(), tuple(sorted(c.metadata.get("tags", []))))
            for c in nb.cells]


def _with_kernelspec(nb):
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata.setdefault("language_info", {"name": "python"})
    return nb


def _strip_run_metadata(nb):
    """Drop papermill's per-run metadata (timestamps, durations) so stored notebooks stay stable."""
    nb.metadata.pop("papermill", None)
    for cell in nb.cells:
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("execution", None)
    return nb


def _copy_outputs(stored, source) -> None:
    """Give each code cell of ``source`` the outputs of the next stored cell with the same code."""
    code = [c for c in stored.cells if c.cell_type == "code"]
    i = 0
    for cell in source.cells:
        if cell.cell_type != "code":
            continue
        j = next((j for j in range(i, len(code)) if code[j].source.strip() == cell.source.strip()), None)
        if j is not None:
            cell.outputs, cell.execution_count, i = code[j].outputs, code[j].execution_count, j + 1


def sync(py_path: Path) -> bool:
    """Make ``py_path``'s ``.ipynb`` carry the ``.py``'s cells and a python3 kernelspec.

    Outputs of code cells whose source is unchanged are kept. Returns True when
    the ``.ipynb`` was (re)written, False when it already agreed.
    """
    import jupytext

    ipynb = py_path.with_suffix(".ipynb")
    source = jupytext.read(py_path, fmt=TEXT_FORMAT)
    if ipynb.exists():
        stored = jupytext.read(ipynb)
        if _cells(stored) == _cells(source) and stored.metadata.get("kernelspec", {}).get("name") == KERNEL:
            return False
        _copy_outputs(stored, source)
    source.metadata.pop("jupytext", None)
    # Stable cell ids (jupytext draws random ones) keep stored notebooks' diffs to real changes.
    for i, cell in enumerate(source.cells):
        cell.id = hashlib.sha1(f"{i}:{cell.cell_type}:{cell.source}".encode()).hexdigest()[:12]
    atomic_write_text(ipynb, jupytext.writes(_with_kernelspec(source), fmt="ipynb"))
    return True


def _cell_difference(a: tuple, b: tuple) -> str:
    """Describe how two cells' (type, source, tags) differ: the first differing line."""
    if a[0] != b[0]:
        return f".py has a {a[0]} cell, .ipynb a {b[0]} cell"
    if a[2] != b[2]:
        return f"tags {list(a[2])} in .py, {list(b[2])} in .ipynb"
    la, lb = a[1].splitlines(), b[1].splitlines()
    n = next((n for n, (x, y) in enumerate(zip(la, lb)) if x != y), min(len(la), len(lb)))
    line = lambda lines: repr(lines[n][:80]) if n < len(lines) else "(no line)"
    return f"line {n + 1}: .py {line(la)} vs .ipynb {line(lb)}"


def check_sync(book_dir: Path = BOOK_DIR) -> list[str]:
    """Differences between every ``.py``/``.ipynb`` pair (empty when all agree).

    A pair differs when a cell's type, source or tags differ, a cell is missing, one side of the
    pair does not exist, or the ``.ipynb`` cannot be read as a notebook; the ``.ipynb`` must also name a
    kernelspec.
    """
    import jupytext

    problems = []
    pys = {p.stem for p in Path(book_dir).glob("[0-9][0-9]_*.py")}
    for stem in sorted({p.stem for p in Path(book_dir).glob("[0-9][0-9]_*.ipynb")} - pys):
        problems.append(f"{stem}.ipynb has no {stem}.py (the .py is the source)")
    for stem in sorted(pys):
        py, ipynb = Path(book_dir) / f"{stem}.py", Path(book_dir) / f"{stem}.ipynb"
        if not ipynb.exists():
            problems.append(f"{ipynb.name} is missing: run `python -m k3lab.book store {stem[:2]}`")
            continue
        try:
            stored = jupytext.read(ipynb)
        except Exception as exc:  # nbformat's NotJSONError, a ValidationError, a UnicodeDecodeError...
            # A notebook left with merge-conflict markers is one problem of the pair, not a crash of the check.
            problems.append(f"{ipynb.name} cannot be read ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:80]}): "
                            f"run `python -m k3lab.book store {stem[:2]}`")
            continue
        a, b = _cells(jupytext.read(py, fmt=TEXT_FORMAT)), _cells(stored)
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            where = _cell_difference(a[i], b[i]) if i < min(len(a), len(b)) else \
                f"{len(a)} cells in .py, {len(b)} in .ipynb"
            problems.append(f"{stem}: .py and .ipynb differ at cell {i}: {where}; "
                            f"run `python -m k3lab.book store {stem[:2]}`")
        elif not stored.metadata.get("kernelspec"):
            problems.append(f"{ipynb.name} has no kernelspec: run `python -m k3lab.book store {stem[:2]}`")
    return problems


def parse_value(text: str):
    """``-p`` values: int, float, true/false, none, else the string itself."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def read_params_file(params_file: Path) -> dict:
    """A parameter YAML: {"all" | chapter prefix | notebook name: {parameter: value}}.

    Raises:
        ValueError: the file is missing, not UTF-8 YAML, not a mapping of mappings, or a section or
            parameter name is not a string (YAML reads an unquoted ``01:`` as the int 1, and a section that
            matches no notebook would be skipped without a word).
    """
    import yaml

    if not Path(params_file).is_file():
        raise ValueError(f"parameter file {params_file} not found")
    try:
        spec = yaml.safe_load(Path(params_file).read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"{params_file} is not valid YAML: {e}") from None
    if not isinstance(spec, dict) or not all(isinstance(v, dict) for v in spec.values()):
        raise ValueError(f"{params_file} must map 'all' / notebook names to parameter mappings")
    for section, values in spec.items():
        bad = [k for k in [section, *values] if not isinstance(k, str)]
        if bad:
            raise ValueError(f"{params_file}: section and parameter names must be strings, got {bad[0]!r} "
                             f"(quote chapter prefixes: \"01\":)")
    return spec


# The Python types a parameter may take, by the kind papermill infers from its declaration's default.
PARAMETER_KINDS = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "list": (list,),
                   "dict": (dict,)}


def notebook_parameters(path: Path, profile: str, overrides: dict, params_file: Path | None) -> dict:
    """Parameters for one notebook: profile, then the parameter file's sections, then ``-p``.

    Only names declared in the notebook's ``parameters`` cell are kept, and each value must have the kind its
    declaration's default has (``-p steps nan`` or ``-p lr abc`` ran the chapter with a NaN or a string).

    Raises:
        ValueError: the parameter file is missing, not YAML or not a mapping of mappings; a value of another
            kind than its declaration (an int where an int is declared, a finite number where a float is, a
            bool, a str; lists and mappings only from the parameter file).
    """
    import papermill

    declared = papermill.inspect_notebook(str(path))
    params = {"profile": profile}
    if params_file is not None:
        spec = read_params_file(params_file)
        stem = path.stem
        for key in ("all", stem.split("_", 1)[0], stem):
            params.update(spec.get(key, {}))
    params.update(overrides)
    params = {k: v for k, v in params.items() if k in declared}
    for k, v in params.items():
        kind = declared[k].get("inferred_type_name")
        if kind not in PARAMETER_KINDS:
            continue  # declared None or an expression: any value
        ok = (isinstance(v, PARAMETER_KINDS[kind]) and (kind == "bool" or not isinstance(v, bool))
              and not (isinstance(v, float) and not math.isfinite(v)))
        if not ok:
            hint = " (give lists and mappings in --params-file)" if kind in ("list", "dict") else ""
            raise ValueError(f"parameter {k} of {path.stem} is declared {kind} (default {declared[k]['default']}), "
                             f"got {v!r}{hint}")
    return params


def _jupyter_env() -> None:
    # Make "python3" resolve to this interpreter's kernel, not a user-level kernelspec elsewhere.
    share = str(Path(sys.prefix) / "share" / "jupyter")
    paths = os.environ.get("JUPYTER_PATH", "")
    if share not in paths.split(os.pathsep):
        os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in (share, paths) if p)


class CellTimeLimitError(RuntimeError):
    """A cell used up its per-cell time limit, though nbclient returned no timeout error."""


# nbclient waits for a cell's reply with one blocking read bounded by the cell limit; when that read
# misses a reply (jupyter/nbclient#312: seen here after an ipywidgets cell whose kernel had answered in
# 0.5 s), it picks the reply up only as the limit runs out and reports success. A cell whose time
# reaches this fraction of the limit is therefore treated as timed out.
LATE_FRACTION = 0.99


def overlong_cell(nb, timeout: float | None) -> str:
    """Describe the first code cell whose papermill duration reached ``LATE_FRACTION`` of ``timeout``
    (``""`` when none did, or when there is no limit)."""
    if timeout is None:
        return ""
    for cell in nb.cells:
        seconds = cell.get("metadata", {}).get("papermill", {}).get("duration")
        if cell.cell_type == "code" and seconds is not None and seconds >= LATE_FRACTION * timeout:
            return (f"cell In [{cell.get('execution_count')}] took {seconds:.1f} s of its {timeout:g} s "
                    f"limit (reply seen only at the limit)")
    return ""


def execute(ipynb: Path, out: Path, parameters: dict, timeout: float | None, progress: bool = True):
    """Execute ``ipynb`` with papermill into ``out`` (kernel python3, cwd = the notebook's folder).

    ``timeout`` is the per-cell limit in seconds, rounded up to whole seconds (nbclient takes an int).

    Raises:
        papermill.PapermillExecutionError: a cell raised.
        nbclient.exceptions.CellTimeoutError: a cell ran past ``timeout``.
        CellTimeLimitError: a cell's reply came back only once the limit had passed (see
            :func:`overlong_cell`).
    """
    import papermill

    _jupyter_env()
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = {"desc": ipynb.stem, "leave": False, "position": 1} if progress else False
    limit = None if timeout is None else math.ceil(timeout)
    nb = papermill.execute_notebook(
        str(ipynb), str(out), parameters=parameters, kernel_name=KERNEL, language="python",
        cwd=str(ipynb.parent), progress_bar=bar, execution_timeout=limit,
    )
    late = overlong_cell(nb, limit)
    if late:
        raise CellTimeLimitError(late)
    return nb


def check_html_templates() -> None:
    """Make sure nbconvert finds its HTML templates before any chapter runs.

    ``pip install --target DIR`` (the README's way onto a GPU node) puts nbconvert's templates in
    ``DIR/share/jupyter``, outside Jupyter's search path, and every page would fail to render after its
    chapter had run. That folder, when it exists, is added to ``JUPYTER_PATH``.

    Raises:
        RuntimeError: no templates found; names ``JUPYTER_PATH`` and the folder to put in it.
    """
    import nbformat
    from nbconvert import HTMLExporter

    def renders() -> bool:
        try:
            HTMLExporter().from_notebook_node(nbformat.v4.new_notebook())
        except ValueError as exc:  # nbconvert: "No template sub-directory with name 'lab' found ..."
            if "template" not in str(exc):
                raise
            return False
        return True

    if renders():
        return
    import nbconvert

    data = Path(nbconvert.__file__).resolve().parents[1] / "share" / "jupyter"
    if (data / "nbconvert" / "templates").is_dir():
        os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(data), os.environ.get("JUPYTER_PATH")]))
        if renders():
            return
    raise RuntimeError(f"nbconvert finds no HTML templates (installed with pip --target?): set JUPYTER_PATH to "
                       f"the folder holding nbconvert/templates (looked in {data})")


def render_html(executed: Path, out: Path) -> None:
    """Render an executed notebook to a self-contained HTML page (images inlined)."""
    import nbformat
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(nbformat.read(executed, as_version=4))
    atomic_write_text(out, body)


def _error_detail(exc: BaseException) -> str:
    name = getattr(exc, "ename", type(exc).__name__)
    value = str(getattr(exc, "evalue", exc)).strip().splitlines()
    # papermill's error names the execution count of the failing cell: In [n] in the executed notebook
    cell = f" in cell In [{exc.exec_count}]" if getattr(exc, "exec_count", None) is not None else ""
    return f"{name}{cell}: {value[0] if value else ''}"[:400]


# Per-cell limits (s). nbclient can wait for a reply until the limit runs out (jupyter/nbclient#312,
# seen here after an ipywidgets cell), so every run has one: it turns a stall into a failed chapter.
# On CPU no cell takes much over a minute; on the GPU profile a cell may compile and autotune Triton
# kernels for several minutes (fla's took ~7 on an H200) before a long benchmark.
CPU_CELL_TIMEOUT = 600.0
GPU_CELL_TIMEOUT = 1800.0
CELL_TIMEOUT = {"cpu": CPU_CELL_TIMEOUT, "gpu": GPU_CELL_TIMEOUT}


def run(only=None, profile="cpu", overrides=None, params_file=None, timeout=None, build_dir=BUILD_DIR,
        book_dir=BOOK_DIR) -> list[Result]:
    """Sync, execute and render chapters; returns one :class:`Result` per notebook. ``timeout``: per-cell
    seconds (None: the profile's ``CPU_CELL_TIMEOUT`` or ``GPU_CELL_TIMEOUT``). A chapter fails when a
    cell raises, runs past the limit, or takes the whole limit before its reply is seen.

    Raises:
        ValueError: bad ``profile``, ``only`` matches no chapter, a bad parameter file, a timeout that is
            not a positive number (0 or less would turn papermill's cell timeout off), a ``build_dir`` (or its
            ``notebooks``/``html``) that is a file or cannot be made or written.
        ModuleNotFoundError: papermill, nbconvert or jupytext missing (checked before any chapter runs).
    """
    from tqdm.auto import tqdm

    if profile not in ("cpu", "gpu"):
        raise ValueError(f"profile must be 'cpu' or 'gpu', got {profile!r}")
    if params_file is None:
        params_file = PARAMS.get(profile)
    if timeout is None:
        timeout = CELL_TIMEOUT[profile]
    if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout}")
    if params_file is not None:
        read_params_file(params_file)  # once, before any chapter runs
    # A file there failed every chapter in turn, then the index with NotADirectoryError.
    for folder in (Path(build_dir), Path(build_dir) / "notebooks", Path(build_dir) / "html"):
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"build_dir (--build-dir) needs {folder} to be a folder, and it is a file")
    # A folder that cannot be made or written failed every chapter in turn and lost the results table.
    problem = blocked_parent(Path(build_dir) / "html" / "index.html")
    if problem is not None:
        raise ValueError(f"build_dir (--build-dir) {build_dir}: {problem}")
    missing = [m for m in ("papermill", "nbconvert", "jupytext") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(f"k3lab.book run needs {', '.join(missing)}: pip install {' '.join(missing)} "
                                  f"(or carry the wheels)")
    check_html_templates()
    paths = chapters(only, book_dir)
    results, used = [], set()
    bar = tqdm(paths, desc="book", unit="notebook", position=0)
    for py in bar:
        bar.set_postfix_str(py.stem)
        start = time.perf_counter()
        try:
            if sync(py):
                tqdm.write(f"synced {py.name} -> {py.with_suffix('.ipynb').name}")
            ipynb = py.with_suffix(".ipynb")
            params = notebook_parameters(ipynb, profile, overrides or {}, params_file)
            used |= set(params)
            executed = Path(build_dir) / "notebooks" / ipynb.name
            try:
                execute(ipynb, executed, params, timeout)
            except Exception:
                # The page of a failed run still shows where it stopped, but the chapter's error is what
                # gets reported: a failure to render must not replace it.
                if executed.exists():
                    with contextlib.suppress(Exception):
                        render_html(executed, Path(build_dir) / "html" / f"{py.stem}.html")
                raise
            render_html(executed, Path(build_dir) / "html" / f"{py.stem}.html")
            results.append(Result(py.stem, "ok", time.perf_counter() - start))
        except Exception as exc:  # a failed chapter must not stop the others
            results.append(Result(py.stem, "FAILED", time.perf_counter() - start, _error_detail(exc)))
    bar.close()
    unused = sorted(set(overrides or {}) - used)
    if unused and any(r.status == "ok" for r in results):
        print(f"warning: no executed notebook declares parameter(s) {unused}; they were not passed",
              file=sys.stderr)
    if results:
        _write_index(results, Path(build_dir) / "html" / "index.html")
    return results


def _write_index(results: list[Result], path: Path) -> None:
    rows = "\n".join(
        f'<tr><td><a href="{r.name}.html">{r.name}</a></td><td>{r.status}</td><td>{r.seconds:.1f}</td></tr>'
        for r in results)
    atomic_write_text(path, f"<!doctype html><title>k3lab book</title><h1>k3lab book</h1>\n"
                            f"<table><tr><th>notebook</th><th>status</th><th>seconds</th></tr>\n{rows}\n</table>\n")


def _record_table(path: str | os.PathLike | None, profile: str) -> tuple[Path, dict, dict]:
    """(path, the table it holds or an empty one, ``run_info`` of this machine) for :func:`record`."""
    import json  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from k3lab.bench import result_path, run_info  # noqa: PLC0415

    info = run_info("cuda" if torch.cuda.is_available() else "cpu")
    path = Path(path) if path else ROOT / result_path(f"book_{profile}", info["device"])
    if not path.exists():
        return path, {"chapters": []}, info
    try:
        table = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--record {path} cannot be read as a run table ({exc}): pass another --record path") from None
    if not (isinstance(table, dict) and isinstance(table.get("chapters", []), list)
            and all(isinstance(r, dict) and isinstance(r.get("name"), str) for r in table.get("chapters", []))):
        raise ValueError(f"--record {path} is not a run table (a JSON object whose 'chapters' lists rows with a "
                         f"'name'): pass another --record path")
    table.setdefault("chapters", [])
    for key, want in (("device", info["device"]), ("profile", profile)):
        if table.get(key, want) != want:
            raise ValueError(f"{path} records {key} {table[key]!r}, this run is {want!r}: pass another --record path")
    return path, table, info


def check_record(path: str | os.PathLike | None = None, profile: str = "gpu") -> Path:
    """The table :func:`record` would write, checked before any chapter runs (so that a wrong ``--record``
    does not surface only after the whole run).

    Raises:
        ValueError: ``path`` exists and is not a readable JSON run table, or records another device or profile,
            or its folder cannot be made or written (``k3lab.files.blocked_parent``).
    """
    table = _record_table(path, profile)[0]
    problem = blocked_parent(table)
    if problem is not None:
        raise ValueError(f"--record {table}: {problem}")
    return table


def record(results: list[Result], path: str | os.PathLike | None = None, profile: str = "gpu",
           overrides: dict | None = None) -> Path:
    """Merge a run's rows into its table, ``data/results/book_<profile>_<card>.json`` by default:
    ``{"device", "profile", "commit", "date", "versions", "chapters": [{"chapter": "01", "name", "status",
    "seconds", "commit", "date", "detail", "overrides"}]}``. A chapter run again replaces its row, so a profile
    longer than one sitting on a GPU node is completed chapter by chapter; each row keeps the commit it ran
    at and the ``-p`` overrides it ran with (a trimmed run is not the profile). Written atomically.

    Raises:
        ValueError: ``path`` holds a table of another device or profile, or is no run table (see
            :func:`check_record`).
    """
    from k3lab.files import write_json  # noqa: PLC0415

    path, table, info = _record_table(path, profile)
    rows = {r["name"]: r for r in table["chapters"]}
    for r in results:
        rows[r.name] = dict(chapter=r.name[:2], name=r.name, status=r.status, seconds=round(r.seconds, 1),
                            commit=info["commit"], date=info["date"], detail=r.detail, overrides=dict(overrides or {}))
    table.update(device=info["device"], profile=profile, commit=info["commit"], date=info["date"],
                 versions=info["versions"], chapters=[rows[k] for k in sorted(rows)])
    write_json(path, table, indent=1)
    return path


def format_table(results: list[Result]) -> str:
    """The run's summary: notebook, status, seconds (and the error of a failed one)."""
    width = max([len("notebook")] + [len(r.name) for r in results])
    lines = [f"{'notebook':<{width}}  {'status':<6}  {'seconds':>8}", "-" * (width + 18)]
    lines += [f"{r.name:<{width}}  {r.status:<6}  {r.seconds:8.1f}" + (f"  {r.detail}" if r.detail else "")
              for r in results]
    lines.append(f"{'total':<{width}}  {'':<6}  {sum(r.seconds for r in results):8.1f}")
    return "\n".join(lines)


def store(keys: list[str], timeout=CPU_CELL_TIMEOUT, book_dir: Path = BOOK_DIR) -> None:
    """Execute chapters on the CPU defaults and keep the outputs in ``book/NN_name.ipynb`` (``timeout``:
    per-cell seconds).

    No parameters are injected (the stored notebook keeps exactly the ``.py``'s cells).

    Raises:
        ValueError: no key given or a key matches no chapter.
        papermill.PapermillExecutionError: a cell failed (the ``.ipynb`` is left as it was).
        CellTimeLimitError, nbclient.exceptions.CellTimeoutError: a cell used up ``timeout``.
    """
    import nbformat

    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
    if not keys:
        raise ValueError("store needs at least one chapter, e.g. `python -m k3lab.book store 00`")
    for py in chapters(keys, book_dir):
        sync(py)
        ipynb = py.with_suffix(".ipynb")
        start = time.perf_counter()
        # papermill saves after every cell: keep that partial copy out of book/ (nbval would collect it)
        with tempfile.TemporaryDirectory(prefix="k3lab-store-") as tmp:
            nb = execute(ipynb, Path(tmp) / ipynb.name, {}, timeout)
        atomic_write_text(ipynb, nbformat.writes(_strip_run_metadata(_with_kernelspec(nb))) + "\n")
        print(f"stored {ipynb.relative_to(Path(book_dir).parent)} ({time.perf_counter() - start:.1f} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3lab.book", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="execute chapters into build/ and print a table")
    p.add_argument("--only", nargs="+", metavar="NN", help="chapter prefixes or names (default: all)")
    p.add_argument("--profile", choices=("cpu", "gpu"), default="cpu",
                   help="cpu: the notebooks' defaults; gpu: also params/h200.yaml")
    p.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                   help="override a parameter (int/float/true/false/none/string)")
    p.add_argument("--params-file", type=Path, default=None, help="parameter YAML instead of the profile's")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"per-cell timeout in seconds (default: {CPU_CELL_TIMEOUT:.0f} on the cpu profile, "
                        f"{GPU_CELL_TIMEOUT:.0f} on gpu)")
    p.add_argument("--build-dir", type=Path, default=BUILD_DIR, help="where notebooks/ and html/ go")
    p.add_argument("--record", nargs="?", const="", default=None, metavar="PATH",
                   help="merge the rows into the run table (default path data/results/book_<profile>_<card>.json)")
    p = sub.add_parser("store", help="execute on CPU defaults and store outputs in book/NN_*.ipynb")
    p.add_argument("chapters", nargs="+", metavar="NN", help="chapter prefixes or names")
    p.add_argument("--timeout", type=float, default=CPU_CELL_TIMEOUT, help="per-cell timeout in seconds")
    sub.add_parser("check-sync", help="fail if a book/NN_*.py and its .ipynb differ in cells")
    args = parser.parse_args(argv)

    if args.cmd == "check-sync":
        try:
            problems = check_sync(BOOK_DIR)
        except ModuleNotFoundError as exc:
            print(f"error: check-sync needs {exc.name}: pip install {exc.name}", file=sys.stderr)
            return 1
        for line in problems:
            print(f"out of sync: {line}", file=sys.stderr)
        n = len(list(BOOK_DIR.glob("[0-9][0-9]_*.py")))
        print(f"check-sync: {n} pair(s), {len(problems)} problem(s)")
        return 1 if problems else 0
    try:
        if args.cmd == "store":
            store(args.chapters, args.timeout, BOOK_DIR)
            return 0
        overrides = {k: parse_value(v) for k, v in args.parameter}
        if args.record is not None:
            check_record(args.record or None, args.profile)
        results = run(args.only, args.profile, overrides, args.params_file, args.timeout, args.build_dir,
                      BOOK_DIR)
    except Exception as exc:
        print(f"error: {_error_detail(exc)}", file=sys.stderr)
        # run, store and check_record raise ValueError only for their arguments: a usage error, as argparse's.
        return 2 if isinstance(exc, ValueError) else 1
    if not results:
        print(f"no chapters found in {BOOK_DIR}", file=sys.stderr)
        return 1
    print(format_table(results))
    print(f"executed notebooks: {args.build_dir / 'notebooks'}  html: {args.build_dir / 'html' / 'index.html'}")
    if args.record is not None:
        try:
            print(f"recorded in {record(results, args.record or None, args.profile, overrides)}")
        except (ValueError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 1 if any(r.status != "ok" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
