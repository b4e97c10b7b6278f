"""Kiln's polite crawler: seed URLs in, one WARC file of request and response records out.

What a URL passes before a byte is fetched, in order:
- scope: the seed hosts (host and port) and `allowed_domains` (and their subdomains);
- depth and page limits;
- the address check: the host is resolved and every address must be public (`ipaddress`), unless
  `allow_private_networks`. The connection then goes to that checked address (Host header and TLS
  name set to the host name), so a second DNS answer cannot steer it elsewhere (DNS rebinding);
- robots.txt of the origin (urllib.robotparser, matched on the product token of the user agent;
  a Crawl-delay longer than the configured delay wins);
- the per-host delay between requests.
While fetching: a Content-Length above the cap is skipped without reading the body, a body without
one is read in chunks and dropped once it passes the cap, and connect, read and whole-page timeouts
apply (the whole-page one by a timer that shuts the socket, so a server dripping bytes just under
the read timeout cannot hold the crawl; a page and its redirect hops share one whole-page time).
A body read to its end leaves its connection in the pool for the host's next request; any other
ends it. Redirects are followed one hop at a time, every hop checked like a new URL, with a hop
limit and loop detection. Every attempt leaves a line in the crawl log: what was refused or
dropped is data.
"""
from __future__ import annotations

import heapq
import ipaddress
import json
import contextvars
import re
import socket
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Callable
from urllib.parse import urldefrag, urljoin, urlsplit, urlunsplit
from urllib.robotparser import RobotFileParser

import urllib3
from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter

REDIRECTS = {301, 302, 303, 307, 308}
DEFAULT_PORTS = {"http": 80, "https": 443}
ROBOTS_MAX_BYTES = 512 * 1024  # RFC 9309: parse at least the first 500 KiB
ROBOTS_MAX_REDIRECTS = 5  # RFC 9309: follow at least five
CHUNK_BYTES = 64 * 1024
MAX_CRAWL_DELAY = 120.0  # a host asking for longer waits is left alone rather than crawled faster
HTML_TYPES = ("text/html", "application/xhtml+xml")


@dataclass(frozen=True)
class CrawlSettings:
    user_agent: str = "KilnBot/0.1"
    allowed_domains: tuple[str, ...] = ()
    max_depth: int = 2
    max_pages: int = 100
    max_bytes_per_page: int = 2_000_000
    delay_seconds: float = 1.0
    timeout_seconds: float = 10.0
    page_timeout_seconds: float = 60.0
    max_redirects: int = 5
    allow_private_networks: bool = False
    ca_bundle: str | None = None  # PEM of trusted CAs; default: certifi's bundle


class FetchRefused(Exception):
    """A URL that was not (completely) fetched; `outcome` is its crawl-log reason."""

    def __init__(self, outcome: str, detail: str = "", nbytes: int = 0):
        super().__init__(f"{outcome}: {detail}" if detail else outcome)
        self.outcome, self.detail, self.nbytes = outcome, detail, nbytes


@dataclass
class Fetched:
    url: str
    ip: str
    status: int
    reason: str
    version: str
    headers: list[tuple[str, str]]
    body: bytes
    request_line: str
    request_headers: list[tuple[str, str]]

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)


# ---------------------------------------------------------------------------------------------
# URLs and addresses
# ---------------------------------------------------------------------------------------------

def normalize_url(url: str, base: str | None = None) -> str | None:
    """Absolute http(s) URL without fragment, user info or default port; None if not crawlable."""
    try:
        url = urldefrag(urljoin(base, url.strip()) if base else url.strip())[0]
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        return None
    host = parts.hostname.lower()
    netloc = f"[{host}]" if ":" in host else host
    if port and port != DEFAULT_PORTS[parts.scheme]:
        netloc += f":{port}"
    return urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))


def is_public_address(address: str) -> bool:
    """False for private, loopback, link-local, shared, reserved, multicast and unspecified addresses."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    return ip.is_global and not ip.is_multicast


def resolve_host(host: str, port: int, allow_private: bool) -> str:
    """The address to connect to; every address the name resolves to must pass the check."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        raise FetchRefused("dns_error", f"{host}: {error}") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not allow_private:
        refused = [a for a in addresses if not is_public_address(a)]
        if refused:
            raise FetchRefused("blocked_address", f"{host} resolves to non-public {refused[0]}")
    return addresses[0]


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port or DEFAULT_PORTS[parts.scheme]


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


class _PageDeadline:
    """The whole-page time limit of one fetch chain (a page and its redirect hops, or robots.txt
    and its), on real time whatever clock paces the crawl.

    urllib3's read timeout bounds each socket read, and a read returns as soon as any byte
    arrives, so a server dripping a byte every few seconds is never timed out by it. Each request
    of the chain runs between start() and stop() and spends the chain's `seconds`; the polite
    waits between hops are the crawler's own time and are not counted. At the deadline a timer
    shuts the socket for reading: a read blocked on the head or the body then returns at once,
    and the request is reported as a timeout.
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.left = seconds  # of the chain, after the requests that ended
        self.expired = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._started: float | None = None
        self._request = 0  # which request a timer belongs to: a late one must not shut the next's socket

    def start(self) -> None:
        """A request of the chain begins (the chain's time runs from here)."""
        with self._lock:
            self._request += 1
            self._started = time.monotonic()

    def watch(self, sock) -> None:
        with self._lock:
            if self._started is None:
                return
            if self._timer is not None:
                self._timer.cancel()
            remaining = self.left - (time.monotonic() - self._started)
            self._timer = threading.Timer(max(0.0, remaining), self._fire, (sock, self._request))
            self._timer.daemon = True
            self._timer.start()

    def _fire(self, sock, request: int) -> None:
        with self._lock:  # never after stop(): the connection may already serve the next request
            if self._started is None or request != self._request:
                return
            self.expired = True
            try:
                # The plain socket call, also under TLS: SSLSocket.shutdown would drop its SSL
                # object under the reading thread.
                socket.socket.shutdown(sock, socket.SHUT_RD)
            except OSError:
                pass

    def stop(self) -> bool:
        """Disarm the timer and charge the request's time to the chain; True if the deadline fired
        (the connection is then unusable)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._started is not None:
                self.left -= time.monotonic() - self._started
                self._started = None
            return self.expired


_PAGE_DEADLINE: contextvars.ContextVar[_PageDeadline | None] = contextvars.ContextVar("kiln_page_deadline", default=None)


class _DeadlineConnection:
    """Arms the current request's deadline on the socket just before the response head is read
    (a kept-alive connection is reused, so connect() is not the place)."""

    def getresponse(self):
        deadline = _PAGE_DEADLINE.get()
        if deadline is not None and self.sock is not None:
            deadline.watch(self.sock)
        return super().getresponse()


class _HTTPConnection(_DeadlineConnection, urllib3.connection.HTTPConnection):
    pass


class _HTTPSConnection(_DeadlineConnection, urllib3.connection.HTTPSConnection):
    pass


class _HTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


# ---------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------

def _charset(content_type: str | None) -> str | None:
    match = re.search(r"charset=[\"']?([\w.:-]+)", content_type or "", re.I)
    return match.group(1) if match else None


def extract_links(body: bytes, base_url: str, content_type: str | None = None) -> list[str]:
    """Followable links of an HTML page, normalized, in document order; none under meta nofollow."""
    from resiliparse.parse.encoding import detect_encoding
    from resiliparse.parse.html import HTMLTree

    tree = HTMLTree.parse_from_bytes(body, _charset(content_type) or detect_encoding(body))
    if tree.document is None:
        return []
    for meta in tree.document.query_selector_all("meta[name]"):
        directives = (meta.getattr("content") or "").lower()
        if (meta.getattr("name") or "").lower() == "robots" and re.search(r"\b(nofollow|none)\b", directives):
            return []
    base = tree.document.query_selector("base[href]")
    if base is not None:
        base_url = normalize_url(base.getattr("href") or "", base_url) or base_url
    links = []
    for anchor in tree.document.query_selector_all("a[href], area[href]"):
        if "nofollow" in (anchor.getattr("rel") or "").lower().split():
            continue
        url = normalize_url(anchor.getattr("href") or "", base_url)
        if url:
            links.append(url)
    return list(dict.fromkeys(links))


# ---------------------------------------------------------------------------------------------
# The crawler
# ---------------------------------------------------------------------------------------------

@dataclass
class _Frontier:
    """Per-host FIFO queues, served host by host in the order the hosts become ready."""

    queues: dict[str, deque] = field(default_factory=dict)
    ready: list = field(default_factory=list)  # heap of (ready time, seq, host), one entry per waiting host
    waiting: set = field(default_factory=set)
    seq: int = 0

    def schedule(self, host: str, when: float) -> None:
        if self.queues.get(host) and host not in self.waiting:
            self.seq += 1
            self.waiting.add(host)
            heapq.heappush(self.ready, (when, self.seq, host))

    def add(self, host: str, item: tuple[str, int], when: float) -> None:
        self.queues.setdefault(host, deque()).append(item)
        self.schedule(host, when)

    def pop(self) -> tuple[str, str, int]:
        _, _, host = heapq.heappop(self.ready)
        self.waiting.discard(host)
        url, depth = self.queues[host].popleft()
        return host, url, depth


class Crawler:
    def __init__(
        self,
        settings: CrawlSettings,
        writer: WARCWriter,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        log: Callable[[str], None] = lambda message: None,
    ):
        self.settings = settings
        self.writer = writer
        self.clock, self.sleep, self.log = clock, sleep, log
        self.entries: list[dict] = []
        self.counts: Counter = Counter()
        self.request_times: dict[str, list[float]] = {}  # host -> clock() at each request start
        self._robots: dict[str, RobotFileParser] = {}
        self.robots_problems: dict[str, str] = {}  # origin -> why its robots.txt counts as "disallow all"
        self._next_request: dict[str, float] = {}
        self._pools: dict[tuple, urllib3.HTTPConnectionPool] = {}
        self._scope_netlocs: set[str] = set()
        self._fetches = 0
        self._seen: set[str] = set()

    # ---- policy --------------------------------------------------------------------------

    def in_scope(self, url: str) -> bool:
        parts = urlsplit(url)
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port or DEFAULT_PORTS[parts.scheme]}"
        if netloc in self._scope_netlocs:
            return True
        return any(host == d or host.endswith("." + d) for d in self.settings.allowed_domains)

    def _host_delay(self, host: str) -> float:
        delays = [self.settings.delay_seconds]
        for origin, robots in self._robots.items():
            if urlsplit(origin).hostname == host:
                delays.append(float(robots.crawl_delay(self.settings.user_agent) or 0))
        return max(delays)

    def _wait_turn(self, host: str) -> None:
        wait = self._next_request.get(host, float("-inf")) - self.clock()
        if wait > 0:
            self.sleep(wait)
        self.request_times.setdefault(host, []).append(self.clock())

    def robots_for(self, url: str) -> RobotFileParser:
        origin = _origin(url)
        if origin in self._robots:
            return self._robots[origin]
        robots = RobotFileParser(origin + "/robots.txt")
        target = origin + "/robots.txt"
        deadline = _PageDeadline(self.settings.page_timeout_seconds)  # one for robots.txt and its redirects
        try:
            for _ in range(ROBOTS_MAX_REDIRECTS + 1):
                got = self._request(target, ROBOTS_MAX_BYTES, deadline, cut_off=True)
                location = got.header("Location")
                if got.status not in REDIRECTS or not location or not normalize_url(location, target):
                    break
                target = normalize_url(location, target)
            if 200 <= got.status < 300:
                robots.parse(got.body.decode("utf-8", "replace").splitlines())
                asked = robots.crawl_delay(self.settings.user_agent)
                if asked and float(asked) > MAX_CRAWL_DELAY:
                    robots.disallow_all = True
                    self.robots_problems[origin] = f"Crawl-delay {asked}s is over {MAX_CRAWL_DELAY:.0f}s"
            elif got.status in (401, 403):
                robots.disallow_all = True  # as urllib.robotparser.read() does
            elif 400 <= got.status < 500:
                robots.allow_all = True  # no robots.txt: everything allowed
            else:
                robots.disallow_all = True  # server errors and endless redirects: stay out (RFC 9309)
                self.robots_problems[origin] = f"robots.txt answered {got.status}"
        except FetchRefused as refused:
            self.log(f"robots.txt of {origin} unavailable ({refused.outcome}); not crawling it")
            self.robots_problems[origin] = f"robots.txt unavailable: {refused}"
            robots.disallow_all = True
        self._robots[origin] = robots
        # The robots.txt request itself was spaced before its Crawl-delay was known; the next one is not.
        host = urlsplit(origin).hostname
        if self.request_times.get(host):
            self._next_request[host] = max(self._next_request.get(host, float("-inf")),
                                           self.request_times[host][-1] + self._host_delay(host))
        return robots

    # ---- HTTP ----------------------------------------------------------------------------

    def _pool(self, scheme: str, ip: str, port: int, host: str) -> urllib3.HTTPConnectionPool:
        key = (scheme, ip, port, host)
        if key not in self._pools:
            if scheme == "https":
                ca_certs = self.settings.ca_bundle
                if ca_certs is None:
                    try:
                        import certifi

                        ca_certs = certifi.where()
                    except ImportError:  # the system's trust store then
                        pass
                self._pools[key] = _HTTPSPool(
                    ip, port, maxsize=1, cert_reqs="CERT_REQUIRED", ca_certs=ca_certs,
                    server_hostname=host, assert_hostname=host,
                )
            else:
                self._pools[key] = _HTTPPool(ip, port, maxsize=1)
        return self._pools[key]

    def _request(self, url: str, max_bytes: int, deadline: _PageDeadline, *, cut_off: bool = False) -> Fetched:
        """One GET to the checked address, spending the time left on its chain's `deadline`;
        `cut_off` keeps the first max_bytes instead of refusing."""
        if deadline.left <= 0:  # the chain's earlier requests spent it all
            raise FetchRefused("timeout", f"redirects took over {deadline.seconds}s (whole-page deadline)")
        parts = urlsplit(url)
        host, port = _host_port(url)
        ip = resolve_host(host, port, self.settings.allow_private_networks)
        path = urlunsplit(("", "", parts.path or "/", parts.query, ""))
        headers = [
            ("Host", parts.netloc),
            ("User-Agent", self.settings.user_agent),
            ("Accept", "text/html,application/xhtml+xml;q=0.9,*/*;q=0.5"),
            ("Accept-Encoding", "identity"),  # raw bytes are what the WARC keeps and the cap counts
        ]
        timeout = urllib3.Timeout(connect=self.settings.timeout_seconds, read=self.settings.timeout_seconds)
        self._wait_turn(host)
        deadline.start()
        token = _PAGE_DEADLINE.set(deadline)
        response, complete, body = None, False, bytearray()
        try:
            response = self._pool(parts.scheme, ip, port, host).urlopen(
                "GET", path, headers=dict(headers), redirect=False, retries=False,
                preload_content=False, assert_same_host=False, timeout=timeout,
            )
            declared = response.headers.get("Content-Length", "")
            if declared.strip().isdigit() and int(declared) > max_bytes and not cut_off:
                raise FetchRefused("too_large", f"Content-Length {int(declared)} > {max_bytes}")
            # read1 returns whatever has arrived (up to a chunk), so the byte count is exact
            # when the deadline or the cap cuts a body off.
            while chunk := response.read1(CHUNK_BYTES, decode_content=False):
                body += chunk
                if len(body) > max_bytes:
                    if cut_off:
                        del body[max_bytes:]
                        break
                    raise FetchRefused("too_large", f"body passed {max_bytes} bytes", len(body))
            else:
                complete = True
        except urllib3.exceptions.TimeoutError as error:
            if not deadline.expired:
                raise FetchRefused("timeout", type(error).__name__, len(body)) from None
        except urllib3.exceptions.HTTPError as error:
            if not deadline.expired:  # else the shut socket is what broke the read
                raise FetchRefused("connection_error", f"{type(error).__name__}: {error}", len(body)) from None
        finally:
            _PAGE_DEADLINE.reset(token)
            expired = deadline.stop()
            if response is not None:
                if not complete or expired:
                    response.close()  # never drain: an unread body stays unread
                response.release_conn()  # complete and in time: back to the pool, kept alive
            self._next_request[host] = self.clock() + self._host_delay(host)
        if expired:
            # Also when the read ended "cleanly": a close-delimited body cut by the shutdown looks complete.
            raise FetchRefused("timeout", f"page took over {deadline.seconds}s (whole-page deadline)", len(body))
        version = {10: "HTTP/1.0", 11: "HTTP/1.1"}.get(response.version, "HTTP/1.1")
        return Fetched(
            url=url, ip=ip, status=response.status, reason=response.reason or "", version=version,
            headers=list(response.headers.items()), body=bytes(body),
            request_line=f"GET {path} HTTP/1.1", request_headers=headers,
        )

    # ---- WARC ----------------------------------------------------------------------------

    def _write(self, got: Fetched) -> None:
        # urllib3 has already undone chunking, so the recorded head must not announce it again.
        headers = [
            ("X-Kiln-Original-Transfer-Encoding", v) if k.lower() == "transfer-encoding" else (k, v)
            for k, v in got.headers
        ]
        warc_headers = {"WARC-IP-Address": got.ip}
        response = self.writer.create_warc_record(
            got.url, "response", payload=BytesIO(got.body), warc_headers_dict=warc_headers,
            http_headers=StatusAndHeaders(f"{got.status} {got.reason}".strip(), headers, protocol=got.version),
        )
        request = self.writer.create_warc_record(
            got.url, "request", payload=BytesIO(b""), warc_headers_dict={
                **warc_headers, "WARC-Concurrent-To": response.rec_headers.get_header("WARC-Record-ID"),
            },
            http_headers=StatusAndHeaders(got.request_line, got.request_headers, is_http_request=True),
        )
        self.writer.write_record(request)
        self.writer.write_record(response)

    # ---- the crawl -----------------------------------------------------------------------

    def _record(self, url: str, depth: int, outcome: str, **extra) -> None:
        self.counts[outcome] += 1
        self.entries.append({"url": url, "depth": depth, "outcome": outcome, **extra})

    def _visit(self, url: str, depth: int, frontier: _Frontier) -> None:
        chain = [url]
        current = url
        # One deadline for the page and every redirect hop to it: a server answering each hop
        # just in time must not stretch a page to (max_redirects + 1) * page_timeout_seconds.
        deadline = _PageDeadline(self.settings.page_timeout_seconds)
        while True:
            host, port = _host_port(current)
            try:
                resolve_host(host, port, self.settings.allow_private_networks)
                if not self.robots_for(current).can_fetch(self.settings.user_agent, current):
                    problem = self.robots_problems.get(_origin(current))
                    self._record(current, depth, "robots_disallowed", **({"detail": problem} if problem else {}))
                    return
                if self._fetches >= self.settings.max_pages:
                    self._record(current, depth, "page_limit")
                    return
                self._fetches += 1
                got = self._request(current, self.settings.max_bytes_per_page, deadline)
            except FetchRefused as refused:
                self._record(current, depth, refused.outcome, detail=refused.detail, bytes=refused.nbytes)
                return
            self._write(got)
            location = got.header("Location")
            if got.status in REDIRECTS and location:
                target = normalize_url(location, current)
                self._record(current, depth, "redirect", status=got.status, bytes=len(got.body), location=target)
                if target is None:
                    return
                if target in chain:
                    self._record(target, depth, "redirect_loop", chain=chain)
                    return
                if len(chain) > self.settings.max_redirects:
                    self._record(target, depth, "too_many_redirects", chain=chain)
                    return
                if not self.in_scope(target):
                    self._record(target, depth, "out_of_scope")
                    return
                if target in self._seen:
                    return  # fetched already, or queued to be
                self._seen.add(target)
                chain.append(target)
                current = target
                continue
            self._record(current, depth, "fetched", status=got.status, bytes=len(got.body))
            content_type = (got.header("Content-Type") or "").lower()
            nofollow = re.search(r"\b(nofollow|none)\b", (got.header("X-Robots-Tag") or "").lower())
            if got.status == 200 and content_type.startswith(HTML_TYPES) and depth < self.settings.max_depth and not nofollow:
                for link in extract_links(got.body, current, got.header("Content-Type")):
                    self._enqueue(frontier, link, depth + 1)
            return

    def _enqueue(self, frontier: _Frontier, url: str, depth: int) -> None:
        if url in self._seen:
            return
        if not self.in_scope(url):
            self.counts["links_out_of_scope"] += 1
            return
        self._seen.add(url)
        host = urlsplit(url).hostname
        frontier.add(host, (url, depth), self._next_request.get(host, float("-inf")))

    def crawl(self, seeds: list[str]) -> dict:
        frontier = _Frontier()
        for seed in seeds:
            url = normalize_url(seed)
            if url is None:
                raise ValueError(f"seed {seed!r} is not an http(s) URL")
            host, port = _host_port(url)
            self._scope_netlocs.add(f"{host}:{port}")
        for seed in seeds:
            self._enqueue(frontier, normalize_url(seed), 0)
        try:
            while frontier.ready and self._fetches < self.settings.max_pages:
                host, url, depth = frontier.pop()
                self._visit(url, depth, frontier)
                frontier.schedule(host, self._next_request.get(host, float("-inf")))
        finally:
            for pool in self._pools.values():
                pool.close()
        left = sum(len(q) for q in frontier.queues.values())
        if left:
            self.counts["not_visited_page_limit"] += left
        return {
            "fetches": self._fetches,
            "responses": self.counts["fetched"] + self.counts["redirect"],
            "pages_ok": sum(1 for e in self.entries if e["outcome"] == "fetched" and e.get("status") == 200),
            "bytes": sum(e.get("bytes", 0) for e in self.entries if e["outcome"] in ("fetched", "redirect")),
            "hosts": len(self.request_times),
            "outcomes": dict(sorted(self.counts.items())),
        }


def crawl_to_warc(
    seeds: list[str],
    warc_path: Path,
    log_path: Path,
    settings: CrawlSettings,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = lambda message: None,
) -> dict:
    """Crawl from `seeds` into one gzipped WARC; one JSON line per URL attempt in `log_path`."""
    warc_path.parent.mkdir(parents=True, exist_ok=True)
    with open(warc_path, "wb") as stream:
        writer = WARCWriter(stream, gzip=True)
        writer.write_record(writer.create_warcinfo_record(warc_path.name, {
            "software": "Kiln crawler (engine/crawler.py)",
            "robots": "obey",
            "http-header-user-agent": settings.user_agent,
            "format": "WARC File Format 1.0",
        }))
        crawler = Crawler(settings, writer, clock=clock, sleep=sleep, log=log)
        stats = crawler.crawl(seeds)
    with open(log_path, "w") as out:
        for entry in crawler.entries:
            out.write(json.dumps(entry, sort_keys=True) + "\n")
    return stats
