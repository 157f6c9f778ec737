"""A headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe: JSON messages ending in a
NUL byte, the browser reading fd 3 and writing fd 4), so a test clicks as a user does: real mouse events at a point
on the page, no extra package, no port."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from pathlib import Path
from typing import Any, Callable


class Browser:
    """One page of a headless Chromium. Stop it with close()."""

    def __init__(self, binary: str, profile: Path, width: int = 1400, height: int = 1000):
        profile.mkdir(parents=True, exist_ok=True)
        self.log = profile.with_name(profile.name + ".log")
        to_browser, self._write = os.pipe()
        self._read, from_browser = os.pipe()
        # bash puts the pipes on the fds the protocol uses (dash takes one-digit fds only); pass_fds keeps them open
        script = f'exec "$0" "$@" 3<&{to_browser} 4>&{from_browser}'
        self.proc = subprocess.Popen(
            ["bash", "-c", script, binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--disable-extensions", "--hide-scrollbars",
             "--mute-audio", f"--user-data-dir={profile}", f"--window-size={width},{height}",
             "--remote-debugging-pipe", "about:blank"],
            pass_fds=(to_browser, from_browser), stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"),
            env={**os.environ, "HOME": str(profile)})
        os.close(to_browser)
        os.close(from_browser)
        self._buffer, self._events, self._next = b"", [], 0
        target = self.send("Target.createTarget", url="about:blank", session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True, session=False)["sessionId"]
        self.send("Page.enable")

    def _message(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read], [], [], left)[0]:
                raise TimeoutError("the browser said nothing")
            chunk = os.read(self._read, 1 << 20)
            if not chunk:
                raise ConnectionError(f"the browser closed its pipe: {self.log.read_text(errors='replace')[-2000:]}")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, timeout: float = 60, session: bool = True, **params: Any) -> dict[str, Any]:
        """Call a DevTools method (on the page's session) and return its result; events that arrive meanwhile are
        kept for wait_for."""
        self._next += 1
        message = {"id": self._next, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        try:
            os.write(self._write, json.dumps(message).encode() + b"\0")
        except BrokenPipeError:
            raise ConnectionError(f"the browser is gone: {self.log.read_text(errors='replace')[-2000:]}") from None
        while True:
            got = self._message(timeout)
            if got.get("id") == self._next:
                if "error" in got:
                    raise RuntimeError(f"{method}: {got['error']}")
                return got.get("result", {})
            self._events.append(got)

    def wait_for(self, event: str, timeout: float = 60) -> dict[str, Any]:
        """The next event of that name (one that came already, first)."""
        for i, got in enumerate(self._events):
            if got.get("method") == event:
                return self._events.pop(i)["params"]
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self._message(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise TimeoutError(f"no {event} within {timeout:g} s") from None
            if got.get("method") == event:
                return got["params"]
            self._events.append(got)

    def open(self, url: str) -> None:
        """Load the page, to its load event."""
        self._events.clear()
        self.send("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str, timeout: float = 60) -> Any:
        """A JavaScript expression's value in the page (awaited when it is a promise)."""
        got = self.send("Runtime.evaluate", timeout=timeout, expression=expression, returnByValue=True,
                        awaitPromise=True)
        if "exceptionDetails" in got:
            raise RuntimeError(f"{expression}: {got['exceptionDetails']}")
        return got["result"].get("value")

    def wait_until(self, expression: str, timeout: float = 60) -> Any:
        """Poll a JavaScript expression until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"never true: {expression}")
            time.sleep(0.2)

    def click(self, where: Callable[[], dict], hovered: str | None = None, timeout: float = 30) -> None:
        """A user's left click on a point of the page: `where()` finds it ({"x", "y"} in the viewport), the mouse moves
        there, then presses and releases. Plotly finds the point under the mouse on the move, in a later frame (seconds
        later on a busy machine), and its click event names the point hovered: `hovered`, a JavaScript expression true
        once it has, is waited for first. Until it is, the mouse moves again to where the point is now: on a busy
        machine the page can still shift after the point was found (a plot above it drawn late)."""
        deadline, attempt = time.monotonic() + timeout, 0
        while True:
            at = where()
            x, y = at["x"] + attempt % 2, at["y"]   # a move to the same pixel may raise no event: one over, inside it
            self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
            if hovered is None:
                time.sleep(0.3)
                break
            attempt += 1
            try:
                self.wait_until(hovered, timeout=min(3 * attempt, max(deadline - time.monotonic(), 0)))
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10, session=False)
        except (OSError, RuntimeError, TimeoutError, ConnectionError):
            pass
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self._read)
        os.close(self._write)
