"""The Batch jobs page in a real browser (Debian's chromium driven by Playwright) on the
real embedded stack: log in to Airflow's UI, open "Batch jobs" from Airflow's navigation,
watch a running job's bar move, cancel it, download its results, read its legends, rate, error
table and results preview, retry its failed lines from the page and follow the "made from" link
back, search, read the user's usage, follow Airflow's dark mode, and follow its links into Airflow's own pages; a viewer sees no cancel
button and gets a 403 if they try. And Airflow's trigger form refusing a bad input with the
API's reason. Screenshots go to docs/ui/.

The stack's simple auth manager knows only ``admin`` (src/llm_batch/devstack/stack.py); the viewer is a
JWT of role viewer signed with the stack's secret (the simple auth manager takes a user
from the token's claims), set as Airflow's session cookie.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from llm_batch.core.run_conf import DEFAULT_MODEL
from tests.e2e.conftest import FEW_SEQS, MODEL, SHOTS, hold_shards, jobs_frame, logged_in, long_batch, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.engine, pytest.mark.airflow]

TIMEOUT_MS = 420_000


def _bar_value(frame, job_id: str) -> int:
    bar = frame.locator(f'tr[data-id="{job_id}"] [role=progressbar]')
    return int(bar.get_attribute("aria-valuenow") or 0) if bar.count() else -1


def test_the_trigger_form_refuses_what_the_api_refuses(e2e_stack, airflow, browser_context):
    """Airflow's trigger form with an input that does not exist: the form shows admission's
    reason (the batch API's words for the same input) and no run is made."""
    base = e2e_stack.base_url
    page = logged_in(browser_context, base, json.loads(e2e_stack.passwords_file.read_text())["admin"])
    runs_before = airflow.call("GET", "/dags/batch_inference/dagRuns")["total_entries"]
    page.goto(f"{base}/dags/batch_inference", wait_until="domcontentloaded")
    # no_wait_after: the dialog is what we wait for. A click while Airflow's single-page app is
    # still routing can leave Playwright waiting on a "scheduled navigation" that never
    # finishes (a 30 s timeout in CI with the dialog already open).
    page.get_by_role("button", name="Trigger").first.click(no_wait_after=True)
    field = page.locator("#element_input_uri")
    field.wait_for(timeout=60_000)
    field.fill("/no/such/input.jsonl")
    with page.expect_response(lambda r: r.url.endswith("/api/v2/dags/batch_inference/dagRuns")
                              and r.request.method == "POST") as answer:
        page.get_by_role("dialog").get_by_role("button", name="Trigger").click(no_wait_after=True)
    assert answer.value.status == 400, answer.value.text()
    reason = answer.value.json()["detail"]
    # The batch API's answer to the same job (the form's defaults, this input) says the same.
    native = httpx.post(f"{base}/batch/v1/jobs", timeout=60,
                        headers={"Authorization": f"Bearer {e2e_stack.ensure_api_key()}"},
                        json={"input_uri": "/no/such/input.jsonl", "model": DEFAULT_MODEL})
    assert native.status_code == 400 and native.json()["message"] in reason, (native.text, reason)
    page.get_by_text(reason[:60]).first.wait_for(timeout=30_000)  # the form says why
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "trigger-form-refused.png"))
    assert airflow.call("GET", "/dags/batch_inference/dagRuns")["total_entries"] == runs_before


def test_batch_jobs_page_in_airflow_ui(e2e_stack, batch_client, job_logs, tmp_path, browser_context):
    SHOTS.mkdir(parents=True, exist_ok=True)
    batch = long_batch(tmp_path / "ui.jsonl", 120, first_tokens=8, step=0)
    job = batch_client.submit(batch, endpoint="/v1/chat/completions", model=MODEL,
                              model_config=FEW_SEQS)
    hold_shards(job.id, 4)  # the bar shows the job mid-run, then moves on at the next hold point
    job_logs.append(job.id)
    base = e2e_stack.base_url
    password = json.loads(e2e_stack.passwords_file.read_text())["admin"]

    page = logged_in(browser_context, base, password)
    # Airflow's navigation has the entry (external_views) and shows our page inside its UI.
    page.get_by_text("Batch jobs").first.click()
    page.wait_for_url(re.compile(r".*/plugin/batch-jobs.*"), timeout=60_000)
    frame = jobs_frame(page)
    frame.wait_for_selector(f'tr[data-id="{job.id}"]', timeout=60_000)

    first = wait_until("the bar to start", lambda: (v := _bar_value(frame, job.id)) > 0 and v, TIMEOUT_MS / 1000)
    hold_shards(job.id, 12)
    wait_until("the bar to move", lambda: _bar_value(frame, job.id) > first, 300, poll=0.5)
    page.screenshot(path=str(SHOTS / "jobs-list.png"))

    frame.click(f'tr[data-id="{job.id}"] a')
    frame.wait_for_selector("button.cancel", timeout=30_000)
    frame.wait_for_selector("#plot-counts path.series-completed", timeout=30_000)
    page.wait_for_timeout(3000)  # a few more history points on the plots
    page.screenshot(path=str(SHOTS / "job-detail.png"))
    frame.click("button.cancel")  # arms it (no modal dialogs in Airflow's sandboxed iframe)
    frame.wait_for_selector('button.cancel[data-armed="yes"]', timeout=10_000)
    with page.expect_response(lambda r: r.url.endswith("/cancel") and r.request.method == "POST") as cancelled:
        frame.click("button.cancel")
    assert cancelled.value.status == 200, cancelled.value.text()
    wait_until("the job to end cancelled", lambda: batch_client.job(job.id).status == "CANCELLED", TIMEOUT_MS / 1000)
    frame.wait_for_selector("a.download-output", timeout=60_000)
    assert frame.locator("button.cancel").count() == 0
    with page.expect_download() as download_info:
        frame.click("a.download-output")
    saved = tmp_path / "output.jsonl"
    download_info.value.save_as(saved)
    done = batch_client.job(job.id)
    assert 0 < len(saved.read_bytes().splitlines()) == done.succeeded < done.total
    page.screenshot(path=str(SHOTS / "job-cancelled.png"))

    # Legends name each plotted line in its colour.
    assert frame.locator("#legend-counts li").count() == 3 and frame.locator("#legend-rate li").count() == 1
    stroke = frame.locator("#plot-counts path.series-failed").get_attribute("stroke")
    swatch = frame.locator('#legend-counts li[data-series="failed"] .swatch').evaluate("e => e.style.background")
    assert stroke == "#e53e3e" and swatch == "rgb(229, 62, 62)", (stroke, swatch)
    # An ended job shows the rate it ran at, not 0.0.
    rate = wait_until("the ended job's tokens/s", lambda: float(
        frame.locator("dt:has-text('Tokens/s') + dd").inner_text()) or None, 30, poll=1)
    assert rate > 0
    # The estimate beside what it took: the expected end beside the real one, no bare "?".
    estimate = frame.locator("dt:has-text('Estimate vs took') + dd").inner_text()
    assert "end expected" in estimate and "(ended " in estimate and "?" not in estimate, estimate
    # The never-run lines as a table: line, custom_id, code, message.
    frame.wait_for_selector("#error-lines tbody tr", timeout=30_000)
    cells = frame.locator("#error-lines tbody tr").first.locator("td").all_inner_texts()
    assert len(cells) == 4 and cells[0].isdigit() and cells[1] and cells[2] == "batch_cancelled", cells

    # The first results as a table (custom_id, answer), in the output file's order.
    preview = frame.locator("#preview tbody tr")
    wait_until("the results preview", lambda: preview.count() == min(5, done.succeeded), 30, poll=1)
    first_result = json.loads(saved.read_bytes().splitlines()[0])["custom_id"]
    assert preview.first.locator("td").first.inner_text() == first_result
    # "Retry failed lines": a new job of the lines that never ran, opened on the page and
    # linked to this one (cancelled at once: running it is not the point here).
    with page.expect_response(lambda r: r.url.endswith(f"/{job.id}/retry") and r.request.method == "POST") as retried:
        frame.click("button.retry")
    assert retried.value.status < 300, retried.value.text()
    retry_id = retried.value.json()["id"]
    job_logs.append(retry_id)
    frame.wait_for_selector(f"#d-title:has-text('{retry_id}')", timeout=30_000)
    assert frame.locator("a.derived-from").inner_text() == job.id
    assert "retry of" in frame.locator("dt:has-text('Made from') + dd").inner_text()
    wait_until("the retry to read its lines", lambda: batch_client.job(retry_id).total or None, 120)
    assert batch_client.job(retry_id).total == done.total - done.succeeded
    batch_client.cancel(retry_id)
    frame.click("a.derived-from")
    frame.wait_for_selector(f"#d-title:has-text('{job.id}')", timeout=30_000)
    # Search from the list: the job by its id's prefix, and its retry by its input file's name
    # (retry-of-<id>.jsonl); nothing for a word no job has.
    frame.click("#back")
    frame.fill("input[name=q]", job.id[:16])
    frame.click("#filters button[type=submit]")

    def shown() -> set[str]:  # one read of the rows (the page re-renders them every 2 s)
        return set(frame.eval_on_selector_all("tr.job", "rows => rows.map(r => r.dataset.id)"))
    wait_until("the search to find the job and its retry", lambda: shown() == {job.id, retry_id}, 30, poll=0.5)
    frame.fill("input[name=q]", f"no-such-{job.id}")
    frame.click("#filters button[type=submit]")
    wait_until("an empty search", lambda: frame.locator("tr.job").count() == 0, 30, poll=0.5)
    # The user's own usage, above the list.
    assert re.match(r"Your usage: [\d,]+ jobs, [\d,]+ requests", frame.locator("#usage").inner_text())
    frame.fill("input[name=q]", "")
    frame.click("#filters button[type=submit]")

    # Airflow's dark mode, as its theme switch stores it (next-themes: localStorage "theme"),
    # then back to light while the page is open: the frame follows both.
    def frame_colours() -> tuple[str, str]:
        from playwright.sync_api import Error as PageError

        try:  # ("", "") while the reloaded frame has no body yet, or is being replaced
            return tuple(jobs_frame(page).evaluate("() => document.body ? [getComputedStyle(document.body)"
                                               ".backgroundColor, document.documentElement.className] : ['', '']"))
        except PageError:
            return ("", "")
    page.evaluate("localStorage.setItem('theme', 'dark')")
    page.reload(wait_until="domcontentloaded")
    wait_until("the frame to go dark", lambda: frame_colours() == ("rgb(26, 32, 44)", "dark"), 60, poll=0.5)
    page.screenshot(path=str(SHOTS / "jobs-list-dark.png"))
    page.evaluate("document.documentElement.classList.replace('dark', 'light')")
    wait_until("the frame to follow back to light", lambda: frame_colours()[0] == "rgb(255, 255, 255)", 30, poll=0.5)
    page.evaluate("localStorage.setItem('theme', 'light')")

    # The links into Airflow's UI move Airflow itself (its router), from inside the iframe:
    # each opens the job on the Batch jobs page, clicks the link, and sees Airflow render the target.
    def follow(link: str, lands_on: str, rendered: str) -> None:
        frame = jobs_frame(page)
        frame.wait_for_selector(f'tr[data-id="{job.id}"] a', timeout=60_000)
        frame.click(f'tr[data-id="{job.id}"] a')
        frame.wait_for_selector(link, timeout=60_000)
        frame.click(link)
        page.wait_for_url(re.compile(lands_on), timeout=30_000)
        page.get_by_text(rendered).first.wait_for(timeout=60_000)

    follow("a.dag-run", r".*/dags/batch_inference/runs/[^/]+$", "finalize")
    # The cancelled job's run on Airflow's own page: its note says CANCELLED and its finalize
    # task is skipped (the run ends success: a cancel is not a pipeline failure).
    page.get_by_text(f"llm-batch job {job.id}: CANCELLED").first.wait_for(timeout=30_000)
    finalize = page.locator("tr", has_text="finalize").first
    wait_until("finalize shown skipped", lambda: "skipped" in finalize.inner_text().lower(), 30, poll=0.5)
    page.screenshot(path=str(SHOTS / "run-cancelled.png"))
    page.go_back()  # to the Batch jobs page, which opens on its list
    follow("a.dag-logs", r".*/dags/batch_inference/runs/[^/]+/tasks/run_shard/mapped$", "run_shard")

    # A viewer: sees the page, no cancel button, and a 403 on a cancel.
    from airflow.api_fastapi.auth.tokens import JWTGenerator

    secret = (e2e_stack.airflow_home / "jwt_secret").read_text().strip()
    viewer = JWTGenerator(secret_key=secret, valid_for=600, audience="apache-airflow").generate(
        {"sub": "vic", "role": "viewer", "teams": []})
    session = httpx.get(f"{base}/batch/ui/api/session", cookies={"_token": viewer}).json()
    assert (session["user"], session["can_submit"]) == ("vic", False)
    refused = httpx.post(f"{base}/batch/ui/api/jobs/{job.id}/cancel", headers={"Authorization": f"Bearer {session['token']}"})
    assert refused.status_code == 403
    viewer_page = browser_context.browser.new_context().new_page() if browser_context.browser else None
    if viewer_page is None:  # a persistent context has no browser to open another from
        browser_context.clear_cookies()
        viewer_page = browser_context.new_page()
    viewer_page.context.add_cookies([{"name": "_token", "value": viewer, "url": base}])
    viewer_page.goto(f"{base}/batch/ui/jobs", wait_until="domcontentloaded")
    viewer_page.wait_for_selector("#who:has-text('vic')", timeout=30_000)
    viewer_page.goto(f"{base}/batch/ui/jobs#job={job.id}")
    viewer_page.wait_for_selector("#message:has-text('404')", timeout=30_000)  # not vic's job: not even seen
    assert viewer_page.locator("button.cancel").count() == 0
    viewer_page.screenshot(path=str(SHOTS / "viewer.png"))
