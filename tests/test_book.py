"""k3lab.book: chapter discovery, .py/.ipynb sync check, parameters, run and store on tiny notebooks."""
import json
import os

import nbformat
import pytest

from k3lab import book

OK_NB = '''# %% [markdown]
# # A tiny chapter

# %% tags=["parameters"]
profile: str = "cpu"
steps: int = 2

# %%
import os
print(f"profile={profile} steps={steps} cwd={os.path.basename(os.getcwd())}")
'''

BAD_NB = '''# %% tags=["parameters"]
profile: str = "cpu"

# %%
raise ZeroDivisionError("chapter 02 is broken")
'''


@pytest.fixture
def tiny_book(tmp_path):
    d = tmp_path / "book"
    d.mkdir()
    (d / "01_ok.py").write_text(OK_NB)
    (d / "02_bad.py").write_text(BAD_NB)
    (d / "README.md").write_text("not a chapter\n")
    return d


def test_chapters_order_and_only(tiny_book):
    assert [p.stem for p in book.chapters(None, tiny_book)] == ["01_ok", "02_bad"]
    assert [p.stem for p in book.chapters(["02", "01_ok"], tiny_book)] == ["01_ok", "02_bad"]
    with pytest.raises(ValueError, match="'07' names no chapter"):
        book.chapters(["07"], tiny_book)


def test_sync_adds_kernelspec_and_check_sync_finds_differences(tiny_book):
    py = tiny_book / "01_ok.py"
    assert book.check_sync(tiny_book)[0].startswith("01_ok.ipynb is missing")
    assert book.sync(py) and not book.sync(py)
    book.sync(tiny_book / "02_bad.py")
    nb = nbformat.read(py.with_suffix(".ipynb"), as_version=4)
    assert nb.metadata.kernelspec.name == "python3"
    assert book.check_sync(tiny_book) == []

    nb.cells[2].source = nb.cells[2].source.replace("steps=", "STEPS=")
    nbformat.write(nb, py.with_suffix(".ipynb"))
    (problem,) = book.check_sync(tiny_book)
    assert "01_ok" in problem and "cell 2" in problem and "store 01" in problem

    nb.cells[2].source = nb.cells[2].source.replace("STEPS=", "steps=")
    nb.cells[1].metadata["tags"] = []
    nbformat.write(nb, py.with_suffix(".ipynb"))
    assert "cell 1" in book.check_sync(tiny_book)[0]

    book.sync(py)
    assert book.check_sync(tiny_book) == []
    (tiny_book / "03_orphan.ipynb").write_text(py.with_suffix(".ipynb").read_text())
    assert book.check_sync(tiny_book) == ["03_orphan.ipynb has no 03_orphan.py (the .py is the source)"]


@pytest.mark.parametrize("content", ["{not json", "", "<<<<<<< HEAD\n{}\n=======\n"],
                         ids=["not-json", "empty", "merge-conflict"])
def test_check_sync_reports_an_unreadable_notebook_as_a_problem(tiny_book, content):
    """A corrupt .ipynb (merge-conflict markers, an empty file) made check-sync raise nbformat's
    NotJSONError with a traceback instead of naming the pair."""
    book.sync(tiny_book / "01_ok.py")
    book.sync(tiny_book / "02_bad.py")
    (tiny_book / "02_bad.ipynb").write_text(content)
    (problem,) = book.check_sync(tiny_book)
    assert problem.startswith("02_bad.ipynb cannot be read") and "store 02" in problem


@pytest.mark.parametrize("text, value", [("3", 3), ("-1.5e-3", -1.5e-3), ("True", True), ("none", None),
                                         ("bf16", "bf16")])
def test_parse_value(text, value):
    assert book.parse_value(text) == value and type(book.parse_value(text)) is type(value)


def test_parameters_layering_and_filtering(tiny_book, tmp_path):
    book.sync(tiny_book / "01_ok.py")
    params_file = tmp_path / "gpu.yaml"
    params_file.write_text('all: {profile: gpu, steps: 5, unknown: 1}\n"01": {steps: 7}\n"02_bad": {steps: 9}\n')
    ipynb = tiny_book / "01_ok.ipynb"
    assert book.notebook_parameters(ipynb, "gpu", {}, params_file) == {"profile": "gpu", "steps": 7}
    assert book.notebook_parameters(ipynb, "cpu", {"steps": 11}, None) == {"profile": "cpu", "steps": 11}
    params_file.write_text("- not a mapping\n")
    with pytest.raises(ValueError, match="must map"):
        book.notebook_parameters(ipynb, "gpu", {}, params_file)
    # -p steps nan or -p steps abc ran the chapter with a NaN or a string.
    for value in (book.parse_value("nan"), book.parse_value("abc"), 2.5, True):
        with pytest.raises(ValueError, match=r"parameter steps of 01_ok is declared int"):
            book.notebook_parameters(ipynb, "cpu", {"steps": value}, None)


def test_run_checks_its_arguments_before_any_chapter(tiny_book, tmp_path):
    """A missing or invalid --params-file failed each chapter separately, after syncing it; --timeout 0
    or -1 turned the cell timeout off."""
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("all: {steps: [1\n")
    for kwargs, match in ((dict(params_file=tmp_path / "missing.yaml"), "not found"),
                          (dict(params_file=bad_yaml), "not valid YAML"),
                          (dict(timeout=0), "timeout must be a positive number"),
                          (dict(timeout=-1.0), "timeout must be a positive number")):
        with pytest.raises(ValueError, match=match):
            book.run(build_dir=tmp_path / "build", book_dir=tiny_book, **kwargs)
    assert not (tmp_path / "build").exists()
    # A file as the build folder failed every chapter, then the index with NotADirectoryError.
    (tmp_path / "build").write_text("")
    with pytest.raises(ValueError, match=r"^build_dir \(--build-dir\) needs .*build to be a folder"):
        book.run(build_dir=tmp_path / "build", book_dir=tiny_book)
    assert not (tiny_book / "01_ok.ipynb").exists()
    # A folder below a file (or in /proc) failed each chapter in turn, then lost the table at the index.
    with pytest.raises(ValueError, match=r"^build_dir \(--build-dir\) .*build/x: .*build is a file, not a folder"):
        book.run(build_dir=tmp_path / "build" / "x", book_dir=tiny_book)
    assert not (tiny_book / "01_ok.ipynb").exists()


@pytest.mark.parametrize("text, match", [
    ('01: {steps: 7}\n', "got 1 "),
    ('"01": {1: 7}\n', "got 1 "),
    (b"\xff\xfe\x00", "not valid YAML"),
], ids=["unquoted-prefix", "int-parameter-name", "not-utf8"])
def test_params_file_rejects_keys_that_would_be_skipped(tiny_book, tmp_path, text, match):
    """YAML reads an unquoted 01: as the int 1: that section matched no notebook and its parameters were
    dropped without a word. A file that is not UTF-8 raised UnicodeDecodeError without naming it."""
    params_file = tmp_path / "gpu.yaml"
    params_file.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=match) as info:
        book.run(params_file=params_file, build_dir=tmp_path / "build", book_dir=tiny_book)
    assert str(params_file) in str(info.value)
    assert not (tmp_path / "build").exists()


@pytest.mark.timeout(180)
def test_run_executes_renders_and_reports_failures(tiny_book, tmp_path, monkeypatch, capsys):
    out = tmp_path / "build"
    monkeypatch.setattr(book, "BOOK_DIR", tiny_book)
    code = book.main(["run", "-p", "steps", "3", "--build-dir", str(out)])
    assert code == 1
    table = capsys.readouterr().out
    assert "01_ok" in table and "ok" in table
    assert "02_bad" in table and "FAILED" in table and "ZeroDivisionError in cell In [3]" in table

    executed = nbformat.read(out / "notebooks" / "01_ok.ipynb", as_version=4)
    printed = "".join(o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.outputs)
    assert "profile=cpu steps=3 cwd=book" in printed
    assert (out / "notebooks" / "02_bad.ipynb").exists()
    assert "A tiny chapter" in (out / "html" / "01_ok.html").read_text()
    assert "02_bad" in (out / "html" / "index.html").read_text()

    assert book.main(["run", "--only", "01", "--build-dir", str(out)]) == 0


def test_run_needs_its_tools_before_any_chapter(tiny_book, tmp_path, monkeypatch):
    """A GPU node without nbconvert executed every chapter and then failed each one at rendering."""
    real = book.importlib.util.find_spec
    monkeypatch.setattr(book.importlib.util, "find_spec", lambda name, *a: None if name == "nbconvert" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="needs nbconvert: pip install nbconvert"):
        book.run(build_dir=tmp_path / "build", book_dir=tiny_book)
    assert not (tmp_path / "build").exists()


@pytest.mark.parametrize("templates_there", [True, False], ids=["found-beside-the-package", "missing"])
def test_html_templates_installed_with_pip_target_are_found_before_any_chapter(tmp_path, monkeypatch,
                                                                               templates_there):
    """Installed with pip --target on a GPU node, nbconvert's templates sat in DIR/share/jupyter, outside
    Jupyter's path: every chapter of the GPU profile ran and then failed at rendering its page."""
    import nbconvert

    site = tmp_path / "site"
    (site / "nbconvert").mkdir(parents=True)
    if templates_there:
        (site / "share" / "jupyter" / "nbconvert" / "templates").mkdir(parents=True)
    monkeypatch.setattr(nbconvert, "__file__", str(site / "nbconvert" / "__init__.py"))
    monkeypatch.delenv("JUPYTER_PATH", raising=False)
    real = nbconvert.HTMLExporter.from_notebook_node

    def export(self, nb, **kw):  # finds its templates only through JUPYTER_PATH, as under --target
        if str(site / "share" / "jupyter") not in os.environ.get("JUPYTER_PATH", ""):
            raise ValueError("No template sub-directory with name 'lab' found in the following paths: ...")
        return real(self, nb, **kw)

    monkeypatch.setattr(nbconvert.HTMLExporter, "from_notebook_node", export)
    if templates_there:
        book.check_html_templates()
        assert os.environ["JUPYTER_PATH"].split(os.pathsep)[0] == str(site / "share" / "jupyter")
    else:
        with pytest.raises(RuntimeError, match="set JUPYTER_PATH to the folder holding nbconvert/templates"):
            book.check_html_templates()


@pytest.mark.timeout(120)
def test_a_failed_render_does_not_hide_the_chapters_error(tiny_book, tmp_path, monkeypatch):
    """Rendering the page of a failed run raised in a finally block and replaced the cell's error."""
    def broken(executed, out):
        raise RuntimeError("renderer broken")

    monkeypatch.setattr(book, "render_html", broken)
    [bad] = book.run(only=["02"], build_dir=tmp_path / "build", book_dir=tiny_book)
    assert bad.status == "FAILED" and "ZeroDivisionError" in bad.detail


def test_record_merges_rows_chapter_by_chapter(tmp_path):
    """A GPU profile longer than one sitting is completed over several runs: a chapter run again replaces
    its row, the others stay, each with its commit and overrides."""
    import json

    path = tmp_path / "book_gpu.json"
    book.record([book.Result("01_kda", "FAILED", 3.0, "ValueError: x"), book.Result("02_flashkda", "ok", 5.0)],
                path, "gpu", {"steps": 60})
    book.record([book.Result("01_kda", "ok", 4.26)], path, "gpu")
    table = json.loads(path.read_text())
    assert [(r["chapter"], r["status"], r["seconds"], r["overrides"]) for r in table["chapters"]] == [
        ("01", "ok", 4.3, {}), ("02", "ok", 5.0, {"steps": 60})]
    assert table["profile"] == "gpu" and {"device", "commit", "date", "versions"} <= table.keys()
    with pytest.raises(ValueError, match="records profile 'gpu', this run is 'cpu'"):
        book.record([book.Result("01_kda", "ok", 1.0)], path, "cpu")


@pytest.mark.parametrize("content, match", [
    ('{"device": "NVIDIA H200", "profile": "gpu", "chapters": []}', "records device 'NVIDIA H200'"),
    ("{not json", "cannot be read as a run table"),
    ("[]", "is not a run table"),
    ('{"chapters": [1]}', "is not a run table"),
    (None, "is a file, not a folder"),
], ids=["other-device", "not-json", "a-list", "bad-rows", "below-a-file"])
def test_record_path_is_checked_before_any_chapter_runs(tiny_book, tmp_path, monkeypatch, capsys, content, match):
    """--record to a table of another device failed only after every chapter had run; a table that was not
    JSON, or JSON of another shape, ended that run in a traceback (AttributeError, KeyError). Now the CLI
    stops first with one line naming --record and the file, and writes nothing."""
    path = tmp_path / "table.json"
    if content is None:  # a path below a file: only writing the table at the end would have found it
        content, path = "", tmp_path / "table.json" / "x.json"
        (tmp_path / "table.json").write_text(content)
    else:
        path.write_text(content)
        with pytest.raises(ValueError, match=match):
            book.record([book.Result("01_ok", "ok", 1.0)], path, "gpu")
    with pytest.raises(ValueError, match=match):
        book.check_record(path, "gpu")
    ran = []
    monkeypatch.setattr(book, "run", lambda *a, **k: ran.append(1) or [])
    assert book.main(["run", "--profile", "gpu", "--record", str(path)]) == 2  # a usage error
    err = capsys.readouterr().err
    assert not ran and err.count("\n") == 1 and err.startswith("error: ValueError: ") and str(path) in err
    assert "Traceback" not in err and (tmp_path / "table.json").read_text() == content


SLEEPY_NB = BAD_NB.replace('raise ZeroDivisionError("chapter 02 is broken")', "import time\ntime.sleep(60)")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_stuck_cell_fails_its_chapter_instead_of_hanging(tiny_book, tmp_path, monkeypatch, capsys, profile):
    """A cell that never finishes (like a lost kernel reply) ends as a FAILED row once the per-cell
    limit passes, on either profile; the other chapters still run."""
    (tiny_book / "02_bad.py").write_text(SLEEPY_NB)
    monkeypatch.setattr(book, "BOOK_DIR", tiny_book)
    code = book.main(["run", "--profile", profile, "--timeout", "1.5", "--build-dir", str(tmp_path / "build")])
    table = capsys.readouterr().out
    assert code == 1
    rows = {line.split()[0]: line for line in table.splitlines()[2:-1]}
    assert rows["01_ok"].split()[1] == "ok", table
    assert rows["02_bad"].split()[1] == "FAILED" and "CellTimeoutError" in rows["02_bad"], table
    assert float(rows["02_bad"].split()[2]) < 30, "the limit (1.5 s, rounded up to 2) must end the cell"


@pytest.mark.parametrize("profile, limit", [("cpu", book.CPU_CELL_TIMEOUT), ("gpu", book.GPU_CELL_TIMEOUT)])
def test_every_profile_runs_with_a_cell_limit(tiny_book, tmp_path, monkeypatch, profile, limit):
    seen = []
    monkeypatch.setattr(book, "execute", lambda ipynb, out, params, timeout: seen.append(timeout))
    monkeypatch.setattr(book, "render_html", lambda *args: None)
    results = book.run(only=["01"], profile=profile, build_dir=tmp_path / "build", book_dir=tiny_book)
    assert [r.status for r in results] == ["ok"] and seen == [limit] and 0 < limit < float("inf")


def test_a_reply_seen_only_at_the_limit_counts_as_a_timeout(tiny_book, tmp_path, monkeypatch):
    """nbclient can miss a reply and pick it up only as the cell limit runs out, then report success
    (jupyter/nbclient#312): a cell that used up its limit fails the chapter all the same."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1", execution_count=1),
                                         nbformat.v4.new_code_cell("explore()", execution_count=2)])
    nb.cells[0].metadata["papermill"] = {"duration": 0.4}
    nb.cells[1].metadata["papermill"] = {"duration": 600.2}
    assert book.overlong_cell(nb, 600) == "cell In [2] took 600.2 s of its 600 s limit (reply seen only at the limit)"
    assert book.overlong_cell(nb, 1800) == "" and book.overlong_cell(nb, None) == ""

    import papermill

    def late_reply(ipynb, out, **kwargs):
        nbformat.write(nb, out)
        return nb

    monkeypatch.setattr(papermill, "execute_notebook", late_reply)
    (result,) = book.run(only=["01"], timeout=600, build_dir=tmp_path / "build", book_dir=tiny_book)
    assert result.status == "FAILED" and result.detail.startswith("CellTimeLimitError: cell In [2] took 600.2 s")


@pytest.mark.timeout(180)
def test_store_keeps_outputs_without_parameters_or_run_metadata(tiny_book):
    book.store(["01"], book_dir=tiny_book)
    nb = json.loads((tiny_book / "01_ok.ipynb").read_text())
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    assert any("profile=cpu steps=2" in "".join(o.get("text", [])) for o in outputs)
    assert "papermill" not in nb["metadata"]
    assert all("papermill" not in c["metadata"] and "execution" not in c["metadata"] for c in nb["cells"])
    assert not any("injected-parameters" in c["metadata"].get("tags", []) for c in nb["cells"])
    first = (tiny_book / "01_ok.ipynb").read_bytes()
    book.store(["01"], book_dir=tiny_book)
    assert (tiny_book / "01_ok.ipynb").read_bytes() == first, "storing twice must give the same file"
    assert sorted(p.name for p in tiny_book.iterdir()) == ["01_ok.ipynb", "01_ok.py", "02_bad.py", "README.md"]
    assert book.check_sync(tiny_book)[0].startswith("02_bad.ipynb is missing")
    with pytest.raises(Exception, match="chapter 02 is broken"):
        book.store(["02"], book_dir=tiny_book)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        book.store(["01"], timeout=0, book_dir=tiny_book)


def test_sync_keeps_outputs_of_unchanged_cells(tiny_book):
    py = tiny_book / "01_ok.py"
    book.sync(py)
    nb = nbformat.read(py.with_suffix(".ipynb"), as_version=4)
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="kept\n")]
    nbformat.write(nb, py.with_suffix(".ipynb"))
    py.write_text(OK_NB.replace("steps: int = 2", "steps: int = 4"))
    assert book.sync(py)
    nb = nbformat.read(py.with_suffix(".ipynb"), as_version=4)
    assert nb.cells[1].source.endswith("steps: int = 4") and nb.cells[1].metadata["tags"] == ["parameters"]
    assert nb.cells[2].outputs[0]["text"] == "kept\n"


def test_readme_papermill_example_sets_a_cell_limit():
    """Plain papermill has no per-cell limit of its own: the README's example must pass one."""
    readme = (book.ROOT / "README.md").read_text()
    lines = [line for line in readme.splitlines() if line.lstrip().startswith("cd book && papermill")]
    assert lines and all("--execution-timeout" in line for line in lines), lines
