"""The ``remote`` reward against a real local HTTP server: OpenRLHF's request shape, both answer shapes, a server
that fails once then answers (retried), and one that never answers in time (a clear error after the retries)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from asyncflow.rewards import RewardConfig, RewardRow, RewardScorer, make_reward_fn
from asyncflow.rewards.remote import RemoteRewardError
from asyncflow.tiny_model import build_tokenizer


class Server:
    """A reward server on a free local port; ``mode`` picks its behaviour, ``requests`` records every body."""

    def __init__(self):
        self.mode, self.requests, self.release = "ok", [], threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the stdlib's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                if server.mode == "slow":
                    server.release.wait(10)  # longer than the client waits; released at teardown
                if server.mode == "fail_once" and len(server.requests) == 1:
                    self.send_response(503)
                    self.end_headers()
                    return
                rewards = [float(len(q)) for q in body["query"]]
                answer = rewards if server.mode == "list" else {"rewards": rewards, "extra_logs": {}}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def server():
    s = Server()
    yield s
    s.close()


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("ascii")


def rows(tok):
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return [RewardRow.of(enc("Q1 "), enc("abc"), "7"), RewardRow.of(enc("Q22 "), enc("a"), {"ground_truth": "8"})]


def scorer(tok, url, **kw):
    cfg = RewardConfig(url=url, backoff_s=0.01, **kw)
    return RewardScorer(make_reward_fn("remote", tok, cfg), tok, cfg, reward_on_error=-1.0)


@pytest.mark.parametrize("mode", ["ok", "list"])
def test_openrlhf_request_and_both_answer_shapes(tok, server, mode):
    server.mode = mode
    s = scorer(tok, server.url)
    out = s.score(rows(tok))
    assert [s.reward for s in out] == [float(len("Q1 abc")), float(len("Q22 a"))]
    assert server.requests == [{"query": ["Q1 abc", "Q22 a"], "prompts": ["Q1 ", "Q22 "], "labels": ["7", "8"]}]
    s.close()
    assert s.fn.client.is_closed


def test_a_failed_request_is_retried(tok, server):
    server.mode = "fail_once"
    out = scorer(tok, server.url, retries=2).score(rows(tok))
    assert [(s.reward, s.error) for s in out] == [(6.0, None), (5.0, None)]
    assert len(server.requests) == 2


def test_a_server_that_times_out_fails_the_chunk_after_the_retries(tok, server):
    server.mode = "slow"
    fn = make_reward_fn("remote", tok, RewardConfig(url=server.url, timeout_s=0.3, retries=1, backoff_s=0.01))
    with pytest.raises(RemoteRewardError) as err:
        fn([[1]], [[2]])
    assert str(err.value).startswith(f"remote reward {server.url}: no rewards after 2 attempts (reward.retries=1, "
                                     "reward.timeout_s=0.3); last error: ReadTimeout")
    assert len(server.requests) == 2
    # In the reward task the chunk's rows get reward_on_error and the error is reported.
    out = scorer(tok, server.url, timeout_s=0.3, retries=0).score(rows(tok))
    assert [s.reward for s in out] == [-1.0, -1.0] and out[0].error.startswith("RemoteRewardError: remote reward")


def test_wrong_answer_shape_and_missing_url(tok, server):
    server.mode = "ok"
    fn = make_reward_fn("remote", tok, RewardConfig(url=server.url, retries=0))
    with pytest.raises(RemoteRewardError, match="got 1 rewards for 2 rows"):
        fn.post({"query": ["x"], "prompts": ["x"], "labels": [None]}, 2)
    with pytest.raises(ValueError, match="needs reward.url"):
        make_reward_fn("remote", tok, RewardConfig())
