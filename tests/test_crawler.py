"""The polite crawler against a real HTTP site on 127.0.0.1 (http.server in a thread)."""
import json
import socket
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import BytesIO

import pytest
from warcio.archiveiterator import ArchiveIterator
from warcio.warcwriter import WARCWriter

from engine.crawler import Crawler, CrawlSettings, crawl_to_warc, extract_links, is_public_address, normalize_url

UA = "KilnTestBot/1.0 (+https://kiln.test/bot)"
ROBOTS = b"User-agent: *\nDisallow: /private/\n\nUser-agent: OtherBot\nDisallow: /\n"
HUGE = 5_000_000_000


def _page(*links: str, extra: str = "") -> bytes:
    anchors = "".join(f'<a href="{href}">{href}</a> ' for href in links)
    return f"<!DOCTYPE html><html><head><title>t</title></head><body><p>text</p>{anchors}{extra}</body></html>".encode()


PAGES = {
    "/": _page("/a.html", "/b.html", "/private/secret.html", "/loop1", "/go-b", "/slow", "/huge", "/stream-big",
               "/a.html#section", "http://elsewhere.invalid/x.html", "/missing.html",
               extra='<a href="/nofollowed.html" rel="nofollow">n</a>'),
    "/a.html": _page("/deep1.html"),
    "/b.html": _page("/"),
    "/deep1.html": _page("/deep2.html"),
    "/deep2.html": _page("/deep3.html"),
    "/deep3.html": _page(),
    "/private/secret.html": _page(),
    "/nofollowed.html": _page(),
}
REDIRECTS = {"/loop1": "/loop2", "/loop2": "/loop1", "/go-b": "/b.html"}
# /hop/0 -> /hop/1 -> ... -> /hop/HOPS (a page), every hop answering after HOP_SECONDS.
HOPS, HOP_SECONDS = 10, 0.6


class Site(BaseHTTPRequestHandler):
    requests: list[tuple[str, str]] = []  # (path, user agent), shared per server via a subclass
    robots = ROBOTS

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        self.requests.append((self.path, self.headers.get("User-Agent", "")))
        if self.path == "/robots.txt":
            return self._send(200, self.robots, "text/plain")
        if self.path in REDIRECTS:
            self.send_response(302)
            self.send_header("Location", REDIRECTS[self.path])
            self.send_header("Content-Length", "0")
            return self.end_headers()
        if self.path == "/slow":
            self.release.wait(10)  # answers only after the test is over: longer than any read timeout
            return self._send(200, _page(), "text/html")
        if self.path == "/huge":
            # Announce 5 GB, send a few bytes, hang up: the crawler must not start reading.
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(HUGE))
            self.end_headers()
            self.wfile.write(b"0123456789")
            self.close_connection = True
            return
        if self.path == "/stream-big":
            # No Content-Length (HTTP/1.0, close-delimited): only streaming can enforce the cap.
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            try:
                for _ in range(64):
                    self.wfile.write(b"x" * 8192)
            except OSError:
                pass  # the crawler hung up once it had enough
            return
        if self.path.startswith("/drip"):
            return self._drip()
        if self.path.startswith("/hop/"):
            return self._hop(int(self.path.rsplit("/", 1)[1]))
        if self.path in PAGES:
            return self._send(200, PAGES[self.path], "text/html; charset=utf-8")
        return self._send(404, b"not found", "text/plain")

    def _drip(self):
        """One byte every 0.1 s, well under the client's read timeout: of the body (/drip: with
        a Content-Length; /drip-close: close-delimited) or of the head itself (/drip-head)."""
        self.close_connection = True
        try:
            if self.path == "/drip-head":
                self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            else:
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                if self.path == "/drip":
                    self.send_header("Content-Length", "10000")
                self.end_headers()
            for _ in range(10000):
                if self.release.wait(0.1):
                    return
                self.wfile.write(b"x")
        except OSError:
            pass  # the crawler hung up

    def _hop(self, n: int):
        if self.release.wait(HOP_SECONDS):
            return
        try:
            if n == HOPS:
                return self._send(200, _page(), "text/html")
            self.send_response(302)
            self.send_header("Location", f"/hop/{n + 1}")
            self.send_header("Content-Length", "0")
            self.end_headers()
        except OSError:
            pass  # the crawler gave up on the chain

    def _send(self, status, body, content_type):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextmanager
def serve_site(robots: bytes = ROBOTS):
    handler = type("SiteHandler", (Site,), {"requests": [], "release": threading.Event(), "robots": robots})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.requests
    finally:
        handler.release.set()
        server.shutdown()
        server.server_close()


@pytest.fixture()
def site():
    with serve_site() as served:
        yield served


def settings(**overrides) -> CrawlSettings:
    base = dict(user_agent=UA, max_depth=2, max_pages=50, max_bytes_per_page=32 * 1024, delay_seconds=0.0,
                timeout_seconds=0.5, page_timeout_seconds=5.0, max_redirects=3, allow_private_networks=True)
    return CrawlSettings(**{**base, **overrides})


def read_warc(path):
    with open(path, "rb") as stream:
        return [
            (r.rec_type, r.rec_headers.get_header("WARC-Target-URI"), r.rec_headers, r.http_headers, r.content_stream().read())
            for r in ArchiveIterator(stream)
        ]


def read_log(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def crawled(tmp_path_factory):
    """One crawl of the whole site, read by several tests."""
    out = tmp_path_factory.mktemp("crawl")
    with serve_site() as (base, requests):
        stats = crawl_to_warc([base + "/"], out / "c.warc.gz", out / "log.jsonl", settings())
    return base, requests, stats, read_warc(out / "c.warc.gz"), read_log(out / "log.jsonl")


def test_crawl_writes_request_and_response_records(crawled):
    base, _, stats, records, _ = crawled
    assert records[0][0] == "warcinfo"
    responses = {uri: (rec, http, body) for kind, uri, rec, http, body in records if kind == "response"}
    requests = {uri: (rec, http) for kind, uri, rec, http, _ in records if kind == "request"}
    assert set(responses) == set(requests)
    for uri, (rec, http) in requests.items():
        # Each request names its response, and carries the configured user agent.
        assert rec.get_header("WARC-Concurrent-To") == responses[uri][0].get_header("WARC-Record-ID")
        assert http.get_header("User-Agent") == UA
        assert responses[uri][0].get_header("WARC-IP-Address") == "127.0.0.1"
    assert responses[base + "/a.html"][2] == PAGES["/a.html"]
    assert responses[base + "/a.html"][1].get_statuscode() == "200"
    assert responses[base + "/missing.html"][1].get_statuscode() == "404"
    assert stats["pages_ok"] == len([u for u in responses if responses[u][1].get_statuscode() == "200"])


def test_crawl_obeys_robots_scope_depth_and_nofollow(crawled):
    base, requests, _, records, log = crawled
    paths = [path for path, _ in requests]
    assert all(agent == UA for _, agent in requests)
    assert paths.count("/robots.txt") == 1  # fetched once per host, then cached
    assert "/private/secret.html" not in paths
    assert {"url": base + "/private/secret.html", "depth": 1, "outcome": "robots_disallowed"} in log
    assert "/nofollowed.html" not in paths
    # Seeds are depth 0: /a.html is 1, /deep1.html 2 (fetched, max_depth), its links not followed.
    assert "/deep1.html" in paths and "/deep2.html" not in paths
    assert len(paths) == len(set(paths)), "every URL is fetched once (fragments dropped, redirects deduplicated)"
    uris = {uri for _, uri, *_ in records}
    assert not any("elsewhere.invalid" in (uri or "") for uri in uris)


def test_redirects_are_followed_and_loops_detected(crawled):
    base, requests, _, records, log = crawled
    outcomes = {(e["url"], e["outcome"]) for e in log}
    assert (base + "/go-b", "redirect") in outcomes
    assert (base + "/loop1", "redirect") in outcomes and (base + "/loop2", "redirect") in outcomes
    assert (base + "/loop1", "redirect_loop") in outcomes
    assert [p for p, _ in requests].count("/loop1") == 1
    redirect = next(http for kind, uri, _, http, _ in records if kind == "response" and uri == base + "/go-b")
    assert redirect.get_statuscode() == "302" and redirect.get_header("Location") == "/b.html"


def test_redirect_hop_limit(site, tmp_path):
    base, requests = site
    crawl_to_warc([base + "/loop1"], tmp_path / "c.warc.gz", tmp_path / "log.jsonl", settings(max_redirects=0))
    log = read_log(tmp_path / "log.jsonl")
    assert [e["outcome"] for e in log] == ["redirect", "too_many_redirects"]
    assert [p for p, _ in requests if p != "/robots.txt"] == ["/loop1"]


def test_slow_endpoint_times_out(crawled):
    base, _, _, records, log = crawled
    entry = next(e for e in log if e["url"] == base + "/slow")
    assert entry["outcome"] == "timeout"
    assert base + "/slow" not in {uri for kind, uri, *_ in records if kind == "response"}


@pytest.mark.parametrize("path", ["/drip", "/drip-close", "/drip-head"])
def test_slow_drip_is_cut_off_at_the_page_deadline(site, tmp_path, path):
    """A server sending a byte every 0.1 s never trips the 0.5 s read timeout; the whole-page
    deadline (1 s) must still end the request, whether the drip is in the body or the head."""
    base, requests = site
    started = time.monotonic()
    stats = crawl_to_warc([base + path], tmp_path / "c.warc.gz", tmp_path / "log.jsonl",
                          settings(timeout_seconds=0.5, page_timeout_seconds=1.0))
    elapsed = time.monotonic() - started
    # Not before the deadline; the upper bound is generous for a loaded CI machine: the point is
    # "cut off", not the 1000 s the drip would take.
    assert 1.0 <= elapsed < 30, elapsed
    (entry,) = read_log(tmp_path / "log.jsonl")
    assert entry["url"] == base + path and entry["outcome"] == "timeout"
    assert "whole-page deadline" in entry["detail"]
    if path != "/drip-head":
        assert 3 <= entry["bytes"] <= 15  # what dripped in before the deadline
    assert stats["pages_ok"] == 0 and [p for p, _ in requests] == ["/robots.txt", path]
    assert base + path not in {uri for _, uri, *_ in read_warc(tmp_path / "c.warc.gz")}


def test_a_redirect_chain_shares_one_page_deadline(site, tmp_path):
    """Every hop answers in 0.6 s, under the 1 s whole-page deadline (and the 2 s read timeout),
    but the chain as a whole gets 1 s: the second hop is cut off with 0.4 s left, instead of the
    chain running to its page in HOPS * 0.6 s."""
    base, requests = site
    started = time.monotonic()
    stats = crawl_to_warc([base + "/hop/0"], tmp_path / "c.warc.gz", tmp_path / "log.jsonl",
                          settings(timeout_seconds=2.0, page_timeout_seconds=1.0, max_redirects=HOPS))
    elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < HOPS * HOP_SECONDS * 0.8, elapsed  # generous above, far below the whole chain
    first, cut = read_log(tmp_path / "log.jsonl")
    assert (first["url"], first["outcome"]) == (base + "/hop/0", "redirect")
    assert (cut["url"], cut["outcome"]) == (base + "/hop/1", "timeout") and "whole-page deadline" in cut["detail"]
    assert stats["pages_ok"] == 0 and [p for p, _ in requests] == ["/robots.txt", "/hop/0", "/hop/1"]


def test_connections_are_reused_after_a_complete_body_only(tmp_path):
    """HTTP/1.1 keep-alive: robots.txt and /a.html share one connection; the cut-off body of
    /stream-big leaves its connection unusable, so /b.html opens a second one."""
    connections = []

    class KeepAlive(Site):
        protocol_version = "HTTP/1.1"
        requests, release, robots = [], threading.Event(), ROBOTS

        def setup(self):
            connections.append(self.client_address)
            super().setup()

    server = ThreadingHTTPServer(("127.0.0.1", 0), KeepAlive)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        stats = crawl_to_warc([base + "/a.html", base + "/stream-big", base + "/b.html"], tmp_path / "c.warc.gz",
                              tmp_path / "log.jsonl", settings(max_depth=0))
    finally:
        KeepAlive.release.set()
        server.shutdown()
        server.server_close()
    assert [p for p, _ in KeepAlive.requests] == ["/robots.txt", "/a.html", "/stream-big", "/b.html"]
    assert stats["pages_ok"] == 2 and stats["outcomes"]["too_large"] == 1
    assert len(connections) == 2, connections


def test_huge_content_length_is_not_downloaded(crawled):
    base, requests, _, records, log = crawled
    entry = next(e for e in log if e["url"] == base + "/huge")
    assert entry["outcome"] == "too_large" and entry["bytes"] == 0
    assert str(HUGE) in entry["detail"]
    assert "/huge" in [p for p, _ in requests]  # asked once, body never read
    assert base + "/huge" not in {uri for _, uri, *_ in records}


def test_streamed_body_is_cut_off_at_the_cap(crawled):
    base, _, _, records, log = crawled
    entry = next(e for e in log if e["url"] == base + "/stream-big")
    assert entry["outcome"] == "too_large"
    # Read stops within one chunk past the 32 KiB cap, far below the 512 KiB the server offers.
    assert 32 * 1024 < entry["bytes"] <= 32 * 1024 + 64 * 1024
    assert base + "/stream-big" not in {uri for _, uri, *_ in records}


def test_page_limit(site, tmp_path):
    base, requests = site
    stats = crawl_to_warc([base + "/"], tmp_path / "c.warc.gz", tmp_path / "log.jsonl", settings(max_pages=3))
    assert stats["fetches"] == 3
    assert len([p for p, _ in requests if p != "/robots.txt"]) == 3
    assert stats["outcomes"]["not_visited_page_limit"] > 0


def test_loopback_is_refused_without_the_flag(site, tmp_path):
    base, requests = site
    port = base.rsplit(":", 1)[1]
    stats = crawl_to_warc([base + "/", f"http://localhost:{port}/a.html"], tmp_path / "c.warc.gz", tmp_path / "log.jsonl",
                          settings(allow_private_networks=False))
    assert requests == [], "not even robots.txt may be fetched from a loopback address"
    assert stats["fetches"] == 0
    assert [e["outcome"] for e in read_log(tmp_path / "log.jsonl")] == ["blocked_address", "blocked_address"]
    assert [kind for kind, *_ in read_warc(tmp_path / "c.warc.gz")] == ["warcinfo"]


@pytest.mark.parametrize("address, public", [
    ("127.0.0.1", False), ("10.0.0.7", False), ("172.16.3.4", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.251", False),
    ("::1", False), ("fe80::1%eth0", False), ("fc00::1", False), ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False),
    ("8.8.8.8", True), ("2606:4700:4700::1111", True), ("::ffff:8.8.8.8", True),
])
def test_address_classification(address, public):
    assert is_public_address(address) is public


class FakeClock:
    """Time that only moves when the crawler sleeps."""

    def __init__(self):
        self.now, self.slept = 0.0, []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def test_per_host_delay_is_kept(site):
    """A fake clock that only moves when the crawler sleeps: every gap between requests to the
    host is at least the delay, and the crawler slept instead of hammering."""
    base, _ = site
    clock = FakeClock()
    crawler = Crawler(settings(delay_seconds=5.0, max_pages=6), WARCWriter(BytesIO(), gzip=True),
                      clock=clock, sleep=clock.sleep)
    crawler.crawl([base + "/"])
    times = crawler.request_times["127.0.0.1"]
    assert len(times) == 7  # robots.txt + 6 pages
    assert all(later - earlier >= 5.0 for earlier, later in zip(times, times[1:], strict=False))
    assert len(clock.slept) == 6


def test_a_longer_robots_crawl_delay_wins():
    with serve_site(b"User-agent: *\nCrawl-delay: 7\nDisallow: /private/\n") as (base, _):
        clock = FakeClock()
        crawler = Crawler(settings(delay_seconds=1.0, max_pages=4), WARCWriter(BytesIO(), gzip=True),
                          clock=clock, sleep=clock.sleep)
        crawler.crawl([base + "/"])
    times = crawler.request_times["127.0.0.1"]
    assert len(times) == 5 and all(b - a >= 7.0 for a, b in zip(times, times[1:], strict=False))


def test_a_host_asking_for_hours_between_requests_is_left_alone(tmp_path):
    with serve_site(b"User-agent: *\nCrawl-delay: 86400\n") as (base, requests):
        stats = crawl_to_warc([base + "/"], tmp_path / "c.warc.gz", tmp_path / "log.jsonl", settings())
    assert stats["fetches"] == 0 and [p for p, _ in requests] == ["/robots.txt"]
    assert "Crawl-delay 86400" in read_log(tmp_path / "log.jsonl")[0]["detail"]


def test_robots_crawl_delay_and_agent_groups(site):
    base, _ = site
    crawler = Crawler(settings(user_agent="OtherBot/2.0"), WARCWriter(BytesIO(), gzip=True))
    robots = crawler.robots_for(base + "/a.html")
    assert not robots.can_fetch("OtherBot/2.0", base + "/a.html")  # its own group disallows everything
    assert robots.can_fetch(UA, base + "/a.html") and not robots.can_fetch(UA, base + "/private/x")


def test_unreachable_robots_means_stay_out(tmp_path):
    # A port nothing listens on: robots.txt cannot be read, so the host is not crawled.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    stats = crawl_to_warc([f"http://127.0.0.1:{port}/"], tmp_path / "c.warc.gz", tmp_path / "log.jsonl", settings())
    assert stats["fetches"] == 0
    assert [e["outcome"] for e in read_log(tmp_path / "log.jsonl")] == ["robots_disallowed"]


def test_extract_links_and_normalize():
    html = (b'<html><head><base href="https://Example.com/docs/"><meta name="robots" content="index"></head><body>'
            b'<a href="a.html#x">a</a><a href="/b?q=1">b</a><a href="mailto:x@y">m</a>'
            b'<a href="HTTP://user:pw@Example.com:80/c">c</a><a href="d" rel="external nofollow">d</a></body></html>')
    assert extract_links(html, "https://example.com/") == [
        "https://example.com/docs/a.html", "https://example.com/b?q=1", "http://example.com/c",
    ]
    assert extract_links(b'<meta name="robots" content="noindex, nofollow"><a href="/x">x</a>', "http://h/") == []
    assert normalize_url("https://h:443") == "https://h/"
    assert normalize_url("ftp://h/x") is None and normalize_url("http://h:99999/") is None


def _self_signed(tmp_path, name: str):
    """A certificate for `name` (an IP address), as key.pem and cert.pem; the cert is its own CA."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(name))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    (tmp_path / f"{name}.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    (tmp_path / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return tmp_path / f"{name}.pem", tmp_path / f"{name}.key"


@pytest.fixture()
def tls_site(tmp_path):
    import ssl

    cert, key = _self_signed(tmp_path, "127.0.0.1")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    handler = type("TlsHandler", (Site,), {"requests": [], "release": threading.Event()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://127.0.0.1:{server.server_address[1]}", cert, handler.requests
    server.shutdown()
    server.server_close()


def test_https_goes_to_the_checked_address_and_verifies_the_certificate(tls_site, tmp_path):
    base, cert, requests = tls_site
    stats = crawl_to_warc([base + "/b.html"], tmp_path / "c.warc.gz", tmp_path / "log.jsonl",
                          settings(max_depth=0, ca_bundle=str(cert)))
    assert stats["pages_ok"] == 1
    assert [p for p, _ in requests] == ["/robots.txt", "/b.html"]
    # An untrusted certificate (another self-signed one) is refused: nothing is fetched.
    (tmp_path / "other").mkdir()
    other, _ = _self_signed(tmp_path / "other", "127.0.0.2")
    stats = crawl_to_warc([base + "/b.html"], tmp_path / "d.warc.gz", tmp_path / "log2.jsonl",
                          settings(max_depth=0, ca_bundle=str(other)))
    assert stats["fetches"] == 0
    entry = read_log(tmp_path / "log2.jsonl")[0]
    assert entry["outcome"] == "robots_disallowed" and "SSLError" in entry["detail"]
