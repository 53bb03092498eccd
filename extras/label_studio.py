"""Human labels as lagged rewards (`annotation = {url = ...}`) from a Label Studio project
(`start_annotator`)."""

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from buffer import Experience
from extras.lagged_rewards import pending_group_rows, set_rewards_many
from extras.pipelines import response_text

RATING_CONFIG = (
    '<View><Header value="$question"/><Text name="response" value="$response"/>'
    '<Choices name="reward" toName="response" choice="single" showInline="true">{choices}'
    "</Choices></View>"
)
PAIR_CONFIG = (
    '<View><Header value="$question"/><Text name="a" value="$a"/><Text name="b" value="$b"/>'
    '<Choices name="preferred" toName="a" choice="single" showInline="true">'
    '<Choice value="A"/><Choice value="B"/></Choices></View>'
)


class LabelStudio:
    """Label Studio's REST API (https://labelstud.io/api), legacy token; ConnectionError (one line)
    on failure."""

    def __init__(self, url: str, token: str, timeout_s: float = 30.0):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.headers = {"Authorization": f"Token {token}", "Content-Type": "application/json"}

    def call(self, method: str, path: str, body=None):
        """The decoded JSON reply to `method` `path` with a JSON `body`."""
        req = urllib.request.Request(
            self.url + path,
            None if body is None else json.dumps(body).encode(),
            self.headers,
            method=method,
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            raise ConnectionError(
                f"Label Studio at {self.url}: {method} {path.split('?')[0]} answered {e.code} "
                f"{e.read()[:200].decode(errors='replace')}"
            ) from None
        except (urllib.error.URLError, OSError) as e:
            raise ConnectionError(
                f"Label Studio at {self.url} cannot be reached: {getattr(e, 'reason', e)}"
            ) from None

    def project(self, title: str, label_config: str) -> int:
        """The id of the project titled `title`, created with `label_config` if missing."""
        found = [
            p
            for p in self.call("GET", "/api/projects?page_size=1000")["results"]
            if p["title"] == title
        ]
        return (
            found[0]["id"]
            if found
            else self.call("POST", "/api/projects", {"title": title, "label_config": label_config})[
                "id"
            ]
        )

    def tasks(self, project: int) -> list[dict]:
        """Every task of the project with its annotations."""
        out, page = [], 1
        while True:
            got = self.call(
                "GET", f"/api/tasks/?project={project}&fields=all&page_size=500&page={page}"
            )
            out += got["tasks"]
            if len(out) >= got["total"] or not got["tasks"]:
                return out
            page += 1


def check_mode(mode: str) -> None:
    """ValueError (one line) unless `mode` is an annotation mode: rating or pairwise."""
    if mode not in ("rating", "pairwise"):
        raise ValueError(f"annotation mode must be rating or pairwise, got {mode!r}")


class Annotator:
    """Human labels as lagged rewards (Trinity-RFT report 2.3.4 and 3.5): `poll()` sends new pending
    groups (rating or pairwise) and turns labels into rewards (pairwise: into
    RUN_DIR/preferences.jsonl too)."""

    def __init__(
        self,
        buffer,
        tokenizer,
        url: str,
        token: str,
        run_dir: str,
        mode: str = "rating",
        choices: dict | None = None,
        timeout_s: float = 3600.0,
        timeout_reward: float = 0.0,
        project: str = "",
    ):
        check_mode(mode)
        self.buffer, self.tokenizer, self.mode, self.run_dir = buffer, tokenizer, mode, run_dir
        self.choices = choices or {"good": 1.0, "bad": 0.0}
        self.timeout_s, self.timeout_reward = timeout_s, timeout_reward
        self.ls = LabelStudio(url, token)
        config = (
            PAIR_CONFIG
            if mode == "pairwise"
            else RATING_CONFIG.format(
                choices="".join(f'<Choice value="{c}"/>' for c in self.choices)
            )
        )
        self.project = self.ls.project(project or f"nanorft {Path(run_dir).name}", config)
        self.sent = {
            t["data"]["group_id"]: time.time() for t in self.ls.tasks(self.project)
        }  # after a restart
        self.metrics = {
            "annotation/sent": 0,
            "annotation/labelled": 0,
            "annotation/timed_out": 0,
            "annotation/waiting": 0,
        }

    def poll(self) -> dict:
        """One round of sending and collecting; returns `metrics` (annotation/*)."""
        groups = {g[0].group_id: g for g in pending_group_rows(self.buffer)}
        new = [g for gid, g in groups.items() if gid not in self.sent]
        if new:
            items = [
                {"data": d} for g in new for d in self._items(g)
            ]  # fields fill the label config's $names
            self.ls.call("POST", f"/api/projects/{self.project}/import", items)
            self.sent.update(dict.fromkeys((g[0].group_id for g in new), time.time()))
            self.metrics["annotation/sent"] += len(new)
        labels: dict[str, dict[int, str]] = {}
        for t in self.ls.tasks(self.project):
            done = [a for a in t["annotations"] if not a["was_cancelled"] and a["result"]]
            if done:
                labels.setdefault(t["data"]["group_id"], {})[t["data"]["index"]] = done[-1][
                    "result"
                ][0]["value"]["choices"][0]
        rewards, pairs, timed_out = {}, [], 0
        for gid, g in groups.items():
            got, late = (
                labels.get(gid, {}),
                time.time() - self.sent.get(gid, time.time()) > self.timeout_s,
            )
            if self.mode == "rating" and (len(got) == len(g) or late):
                rewards[gid] = [
                    self.choices.get(got[i], self.timeout_reward)
                    if i in got
                    else self.timeout_reward
                    for i in range(len(g))
                ]
            elif self.mode == "pairwise" and (got or late):
                rewards[gid] = [self.timeout_reward] * len(g)
                if got:
                    win = 0 if got[0] == "A" else 1
                    rewards[gid][win], rewards[gid][1 - win] = 1.0, 0.0
                    pairs.append(
                        {
                            "prompt": self._question(g),
                            "chosen": response_text(g[win], self.tokenizer),
                            "rejected": response_text(g[1 - win], self.tokenizer),
                        }
                    )
            timed_out += (
                gid in rewards and late and len(got) < (1 if self.mode == "pairwise" else len(g))
            )
        if rewards:
            set_rewards_many(self.buffer, rewards)
            if pairs:
                with open(f"{self.run_dir}/preferences.jsonl", "a") as f:
                    f.writelines(json.dumps(p) + "\n" for p in pairs)
        self.metrics["annotation/labelled"] += len(rewards) - timed_out
        self.metrics["annotation/timed_out"] += timed_out
        self.metrics["annotation/waiting"] = len(groups) - len(rewards)
        return self.metrics

    def _question(self, g: list[Experience]) -> str:
        prompt = g[0].tokens[: g[0].prompt_length]
        return (
            g[0].info.get("question")
            or self.tokenizer.decode(prompt, skip_special_tokens=True).strip()
        )

    def _items(self, g: list[Experience]) -> list[dict]:
        q = self._question(g)
        if self.mode == "pairwise":
            return [
                {
                    "question": q,
                    "a": response_text(g[0], self.tokenizer),
                    "b": response_text(g[1 % len(g)], self.tokenizer),
                    "group_id": g[0].group_id,
                    "index": 0,
                }
            ]
        return [
            {
                "question": q,
                "response": response_text(e, self.tokenizer),
                "group_id": e.group_id,
                "index": i,
            }
            for i, e in enumerate(g)
        ]

    def run(
        self, stop: threading.Event, poll_s: float = 2.0, log: Callable[[dict], None] | None = None
    ) -> None:
        """Poll until `stop` is set; a failed poll is reported on stderr and retried."""
        while not stop.is_set():
            try:
                m = self.poll()
                if log:
                    log(dict(m))
            except ConnectionError as e:
                print(f"annotation: {e}; retrying", file=sys.stderr, flush=True)
            stop.wait(poll_s)


def check_annotation(cfg) -> None:
    """Check cfg.annotation: ValueError (one line) for a bad mode, URL or token; ConnectionError: no
    server."""
    check_mode(cfg.annotation.get("mode", "rating"))
    label_studio(cfg).call("GET", "/api/projects?page_size=1")


def label_studio(cfg) -> LabelStudio:
    """LabelStudio for cfg.annotation["url"], token in LABEL_STUDIO_API_KEY; ValueError (one line)
    if missing."""
    token = os.environ.get("LABEL_STUDIO_API_KEY", "")
    if not cfg.annotation.get("url") or not token:
        raise ValueError(
            'annotation needs {"url": "http://HOST:PORT"} and the Label Studio token in '
            "LABEL_STUDIO_API_KEY (a legacy token: label-studio start --enable-legacy-api-token)"
        )
    return LabelStudio(cfg.annotation["url"], token)


def start_annotator(cfg, tokenizer, stop: threading.Event) -> Callable[[], dict]:
    """A daemon thread running an Annotator until `stop`; returns its metrics getter (RuntimeError
    once it died)."""
    from extras.postgres import open_buffer

    latest, failed = {}, []
    url = label_studio(cfg).url  # ValueError without url or token
    kwargs = {k: v for k, v in cfg.annotation.items() if k != "url"}

    def work():
        try:
            buf = open_buffer(cfg.buffer, cfg.run_dir)
            try:
                Annotator(
                    buf, tokenizer, url, os.environ["LABEL_STUDIO_API_KEY"], cfg.run_dir, **kwargs
                ).run(stop, log=latest.update)
            finally:
                buf.close()
        # any error, not only the ConnectionError that run() retries: metrics() raises it
        except Exception as e:
            failed.append(e)

    def metrics() -> dict:
        if failed:
            e = failed[0]
            raise RuntimeError(
                f"annotator failed: {type(e).__name__}: {' '.join(str(e).split())}"
            ) from e
        return dict(latest)

    threading.Thread(target=work, name="annotator", daemon=True).start()
    return metrics
