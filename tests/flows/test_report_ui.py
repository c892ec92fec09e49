"""What a user sees: report.html per build, `python -m flows.compare` across builds, and the MLflow UI opened in a
real (headless Chromium) browser on a real build's run. Screenshots land in test-artifacts/browser/."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.flows.test_build_flow import build

REPO = Path(__file__).resolve().parents[2]
SHOTS = REPO / "test-artifacts" / "browser"
CHROMIUM = os.environ.get("TRTFORGE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-quic"]


@pytest.fixture(scope="module")
def sweep(prefect_harness, user_config_dir, tmp_path_factory):
    """A 2x2 sweep (targets x precisions) of the tiny model, tracked in a store of its own."""
    tmp = tmp_path_factory.mktemp("sweep")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp / 'mlflow.db'}")
        runs = [build(["model=tiny", f"target={t}", f"precision={p}"], user_config_dir, tmp)
                for t in ("sm_80", "sm_86") for p in ("fp32", "fp16")]
        yield tmp, runs


class Page(HTMLParser):
    """The numbers (data-key/data-value), image sources and any external references of a page."""

    def __init__(self, text: str):
        super().__init__()
        self.numbers, self.images, self.external, self._num = [], [], [], None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "data-key" in a:
            self._num = [a["data-key"], json.loads(a["data-value"]), ""]
        if tag == "img":
            self.images.append(a.get("src", ""))
        for k in ("src", "href"):
            if re.match(r"(https?:)?//", a.get(k) or ""):
                self.external.append(a[k])

    def handle_data(self, data):
        if self._num is not None:
            self._num[2] += data

    def handle_endtag(self, tag):
        if self._num is not None and tag == "span":
            self.numbers.append(tuple(self._num))
            self._num = None


def lookup(doc, path: str):
    for part in re.findall(r"[^.\[\]]+", path):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def check_numbers(numbers, docs: dict) -> int:
    """Each number on the page is the file's value, shown to the precision it is printed with."""
    checked = 0
    for key, value, shown in numbers:
        doc, path = key.split(":", 1)
        if doc not in docs:
            continue
        assert lookup(docs[doc], path) == value, key
        if isinstance(value, float) and "%" not in shown:
            assert float(shown.replace(",", "")) == pytest.approx(value, rel=1e-5, abs=1e-12), (key, shown)
        checked += 1
    return checked


def test_report_is_self_contained_and_every_number_is_from_the_result(sweep):
    _, runs = sweep
    s = runs[1]  # sm_80 fp16
    out = Path(s["out_dir"])
    text = (out / "report.html").read_text()
    page = Page(text)
    assert not page.external and "<script" not in text
    assert len(page.images) >= 2 and all(src.startswith("data:image/png;base64,") for src in page.images)
    assert (out / "accuracy.png").stat().st_size > 5000 and (out / "latency.png").stat().st_size > 5000
    docs = {n: json.loads((out / f"{n}.json").read_text()) for n in ("summary", "validation", "benchmark")}
    assert check_numbers(page.numbers, docs) >= 20
    shown = {k for k, _, _ in page.numbers}
    assert {"summary:metrics.cosine_min", "summary:engines[0].bytes", "benchmark:native.p50_ms",
            "summary:stages.build.seconds"} <= shown
    # per-iteration times behind the histogram; what was not measured (engine timing here) is not on the page
    assert len(docs["benchmark"]["native"]["times_ms"]) == docs["benchmark"]["native"]["runs"]
    assert "benchmark:engine.p50_ms" not in shown and "engine latency not measured" in text
    assert "precision fp16 needs no calibration" in text
    assert "random inputs inside the profiles: the verdict says nothing about real inputs" in text  # thin evidence, said
    # the MLflow run has it at the artifact root, the plots under reports/
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{sweep[0] / 'mlflow.db'}")
    top = {a.path for a in client.list_artifacts(s["mlflow"]["run_id"])}
    assert {"report.html", "summary.json", "engine", "reports"} <= top
    assert {"reports/accuracy.png", "reports/latency.png"} <= {a.path for a in client.list_artifacts(s["mlflow"]["run_id"], "reports")}


def test_compare_prints_one_row_per_build_and_writes_compare_html(sweep, tmp_path):
    store, runs = sweep
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store / 'mlflow.db'}"}
    r = subprocess.run([sys.executable, "-m", "flows.compare", "model=tiny"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:4] == ["model", "target", "precision", "status"]
    rows = [ln.split() for ln in lines[1:5]]
    assert [x[:4] for x in rows] == [["tiny", t, p, "ok"] for t in ("sm_80", "sm_86") for p in ("fp16", "fp32")]
    by = {(s["target"], s["precision"]): s for s in runs}
    for x in rows:
        s = by[(x[1], x[2])]
        if "cosine_min" in s["metrics"]:
            assert float(x[4]) == pytest.approx(s["metrics"]["cosine_min"], abs=1e-6)
        else:  # fp32 here: nothing was measured (identical graph), and the table does not make a number up
            assert x[2] == "fp32" and x[4] == "-"
        assert float(x[5]) == pytest.approx(s["engine"]["bytes"] / 1e6, abs=0.01)
        assert s["mlflow"]["run_id"].startswith(x[-1])
    page = Page((tmp_path / "compare.html").read_text())
    assert len(page.images) == 1 and not page.external
    assert {v for k, v, _ in page.numbers if k.endswith(":cosine_min")} == \
        {s["metrics"]["cosine_min"] for s in runs if "cosine_min" in s["metrics"]}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    logged = client.search_runs([client.get_experiment_by_name("trtforge-compare").experiment_id])
    assert len(logged) == 1 and {a.path for a in client.list_artifacts(logged[0].info.run_id)} >= {"compare.html", "compare.json"}
    # nothing tracked for that model: no rows, says so, still a page
    r = subprocess.run([sys.executable, "-m", "flows.compare", "model=nosuch"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout == "" and "no tracked builds" in r.stderr


# --- the MLflow UI in a real browser ------------------------------------------------------------------------------

def browser_or_skip():
    try:
        from playwright.sync_api import sync_playwright  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no Chromium at {CHROMIUM}: `make browser` installs Debian's chromium (apt-get), which failed or "
                    "was not run on this host")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class UI(str):
    """The UI's address (http://127.0.0.1:PORT), with the address `make ui` printed (`printed`: it logs in) and the
    Authorization header of its credentials (`auth`)."""
    printed: str
    auth: dict


@pytest.fixture(scope="module")
def mlflow_ui(sweep):
    """`python -m flows.ui` (what `make ui` runs) over the sweep's store, stopped with its process group."""
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{sweep[0] / 'mlflow.db'}"}
    log = open(sweep[0] / "ui.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "flows.ui", "--port", str(port)], cwd=sweep[0], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = UI(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the MLflow UI did not come up: {(sweep[0] / 'ui.log').read_text()[-2000:]}")
            time.sleep(0.5)
        url.printed = re.search(r"open (http://\S+)", (sweep[0] / "ui.log").read_text()).group(1)
        user, password = re.match(r"http://([^:@/]+):([^@/]+)@127\.0\.0\.1:", url.printed).groups()
        import base64

        url.auth = {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_mlflow_ui_shows_the_run_its_artifacts_and_report_in_a_real_browser(sweep, mlflow_ui, user_config_dir):
    browser_or_skip()
    from playwright.sync_api import sync_playwright

    store, runs = sweep
    conf = user_config_dir
    s = runs[3]  # sm_86 fp16
    run_id, exp_id = s["mlflow"]["run_id"], s["mlflow"]["experiment_id"]
    summary = json.loads((Path(s["out_dir"]) / "summary.json").read_text())
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            # a browser without the credentials gets the basic-auth challenge, and no page (headless: no prompt)
            anon = browser.new_context()
            reply = anon.request.get(f"{mlflow_ui}/")
            assert reply.status == 401 and reply.headers.get("www-authenticate") == 'Basic realm="mlflow"'
            anon.close()
            ui = browser.new_page(viewport={"width": 1400, "height": 1000})
            # the address `make ui` printed logs in and lands on the experiment, at an address without credentials
            ui.goto(mlflow_ui.printed)
            ui.wait_for_url(f"{mlflow_ui}/#/experiments/{exp_id}?workflowType=machine_learning", timeout=30_000)
            # a run opened by its bare address: the model-training view, the Assistant closed, its verdict as its
            # description
            ui.goto(f"{mlflow_ui}/#/experiments/{exp_id}/runs/{run_id}")
            header = ui.get_by_test_id("runs-header")
            header.wait_for(timeout=90_000)
            assert "tiny-sm_86-fp16" in header.inner_text()
            ui.get_by_text(run_id).first.wait_for(timeout=30_000)
            ui.get_by_text("tiny → sm_86 fp16", exact=False).first.wait_for(timeout=30_000)
            ui.screenshot(path=str(SHOTS / "1-run.png"))
            assert ui.evaluate("localStorage.getItem('mlflow.workflowType_v1')") == '"machine_learning"'
            assert ui.get_by_text("Welcome to MLflow Assistant").count() == 0
            assert ui.get_by_text("Evaluations", exact=True).count() == 0

            ui.get_by_role("tab", name="Artifacts").click()
            for name in ("engine", "reports", "summary.json", "report.html", "config.yaml"):
                ui.get_by_text(name, exact=True).first.wait_for(timeout=30_000)
            ui.get_by_text("engine", exact=True).first.click()
            ui.get_by_text(s["engine"]["file"], exact=True).first.wait_for(timeout=30_000)
            ui.screenshot(path=str(SHOTS / "2-artifacts.png"))

            # the MLflow server serves the very report.html the result folder holds
            url = f"{mlflow_ui}/get-artifact?path=report.html&run_uuid={run_id}"
            with pytest.raises(urllib.error.HTTPError) as refused:  # not without the credentials
                urllib.request.urlopen(url, timeout=30)
            assert refused.value.code == 401
            served = urllib.request.urlopen(urllib.request.Request(url, headers=mlflow_ui.auth), timeout=30).read()
            assert served == (Path(s["out_dir"]) / "report.html").read_bytes()
            # (MLflow serves it as a download; a person opens it from there or from the result folder)

            # the copy in the result folder, as a person opens it from disk
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.goto((Path(s["out_dir"]) / "report.html").as_uri())
            check_rendered_report(page.main_frame, summary)
            page.screenshot(path=str(SHOTS / "4-report.png"), full_page=True)

            # a build from the CLI: its run lasts what the CLI said, and the experiment opens in the training view
            env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store / 'mlflow.db'}"}
            r = subprocess.run([sys.executable, "-m", "flows.build", "--config-dir", str(conf), "model=tiny",
                                "target=sm_89", "precision=fp32", "stages.benchmark=false", f"out_dir={store / 'out'}",
                                f"cache_dir={store / 'cache'}", f"summary_out={store / 'cli.json'}"],
                               cwd=store, env=env, capture_output=True, text=True, timeout=600)
            said = float(re.search(r": ok in ([0-9.]+)s", r.stdout).group(1))
            cli_run = json.loads((store / "cli.json").read_text())["mlflow"]["run_id"]
            ui.goto(f"{mlflow_ui}/#/experiments/{exp_id}/runs/{cli_run}")
            duration = ui.get_by_test_id("key-value-Duration")
            duration.wait_for(timeout=90_000)
            shown = _seconds(duration.inner_text())
            assert abs(shown - said) <= 0.1 * said + 0.05, (duration.inner_text(), said)
            ui.screenshot(path=str(SHOTS / "5-duration.png"))
            from flows.tracking import ui_link

            ui.goto(ui_link(mlflow_ui, exp_id))  # the address `make ui` and the CLI print
            try:
                ui.get_by_role("link", name="tiny-sm_89-fp32").first.wait_for(timeout=90_000)  # the runs table
            finally:
                ui.screenshot(path=str(SHOTS / "6-experiment.png"))
            assert ui.get_by_text("Evaluation runs").count() == 0  # not MLflow 3's GenAI view
            ui.screenshot(path=str(SHOTS / "6-experiment.png"))
        finally:
            browser.close()


def _seconds(text: str) -> float:
    """MLflow's duration text ("6.1s", "1.2min", "Duration 6.1s") in seconds."""
    m = re.search(r"([0-9.]+)\s*(ms|s|min|h)\b", text)
    value, unit = float(m.group(1)), m.group(2)
    return value * {"ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}[unit]


def wait_for_frame(page, text: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for f in page.frames:
            if f is not page.main_frame:
                try:
                    if text in f.inner_text("body", timeout=1000):
                        return f
                except Exception:  # a frame still loading or gone
                    pass
        time.sleep(0.3)
    raise AssertionError(f"no frame showing {text!r}; frames: {[f.url for f in page.frames]}")


def check_rendered_report(frame, summary: dict) -> None:
    """Every image decoded, and the numbers a person reads are the ones in summary.json."""
    frame.wait_for_function("Array.from(document.images).every(i => i.complete)", timeout=30_000)
    sizes = frame.evaluate("Array.from(document.images).map(i => [i.alt, i.naturalWidth, i.naturalHeight])")
    assert len(sizes) >= 2 and all(w > 100 and h > 100 for _, w, h in sizes), sizes
    assert {"accuracy per output and validation input", "latency per run (histogram)"} <= {a for a, _, _ in sizes}
    numbers = frame.evaluate("Array.from(document.querySelectorAll('[data-key]'))"
                             ".map(e => [e.dataset.key, JSON.parse(e.dataset.value), e.textContent])")
    assert check_numbers(numbers, {"summary": summary}) >= 8
    text = frame.inner_text("body")
    assert f"{summary['metrics']['cosine_min']:.6g}" in text and summary["engine"]["sha256"] in text
