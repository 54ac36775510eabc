"""A page loaded in real headless Chromium (the system package), driven over the DevTools
protocol with ``websockets``: the errors it logged, each video's decoding, each image's size and
a screenshot. For the report test; Chromium comes from scripts/setup.sh's apt step."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# Each video: wait until its first frame decodes (or it fails), then draw that frame on a canvas
# and count the distinct pixel values, so a video that "loads" but decodes to nothing shows.
VIDEOS_JS = """
Promise.all([...document.querySelectorAll('video')].map(v => new Promise(done => {
  const report = () => {
    let colours = 0;
    if (v.readyState >= 2) {
      const c = document.createElement('canvas');
      c.width = v.videoWidth; c.height = v.videoHeight;
      const g = c.getContext('2d');
      g.drawImage(v, 0, 0);
      const px = g.getImageData(0, 0, c.width, c.height).data;
      const seen = new Set();
      for (let i = 0; i < px.length; i += 4) seen.add(px[i] << 16 | px[i + 1] << 8 | px[i + 2]);
      colours = seen.size;
    }
    done({ready: v.readyState, width: v.videoWidth, height: v.videoHeight,
          duration: v.duration, error: v.error ? v.error.code : null, colours: colours});
  };
  if (v.readyState >= 2) report();
  else { v.addEventListener('loadeddata', report); v.addEventListener('error', report); }
})))
"""

IMAGES_JS = """
[...document.images].map(i => {
  const r = i.getBoundingClientRect();
  return {alt: i.alt, complete: i.complete, natural_width: i.naturalWidth,
          x: r.x + window.scrollX, y: r.y + window.scrollY, width: r.width, height: r.height};
})
"""


@dataclass
class PageCheck:
    errors: list[str]  # exceptions, console errors and failed loads the page logged
    videos: list[dict]  # per <video>: ready state, size, duration, error code, colours drawn
    images: list[dict]  # per <img>: complete, natural width, its box on the page
    screenshot: bytes  # PNG of the whole page


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class _DevTools:
    def __init__(self, url: str):
        from websockets.sync.client import connect

        self.socket = connect(url, max_size=None, open_timeout=None)
        self.next_id = 0
        self.events: list[dict] = []

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.socket.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self.events.append(message)

    def wait_for(self, method: str) -> None:
        while not any(e.get("method") == method for e in self.events):
            self.events.append(json.loads(self.socket.recv()))

    def evaluate(self, expression: str):
        result = self.call(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"]["value"]


def check_page(path: Path, width: int = 1280) -> PageCheck:
    """Load ``path`` (file://) in headless Chromium and check it as PageCheck says."""
    # (a profile's cleanup is not what is checked: a helper Chromium started outside its
    # process group may still be writing into it)
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        process = subprocess.Popen(
            [
                chromium(),
                "--headless=new",
                "--no-sandbox",  # (root in a container)
                "--disable-gpu",
                "--no-first-run",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                f"--window-size={width},900",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its renderers and helpers in its process group
        )
        try:
            port = _devtools_port(Path(profile) / "DevToolsActivePort", process)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as response:
                targets = json.loads(response.read())
            page = next(t for t in targets if t["type"] == "page")
            tools = _DevTools(page["webSocketDebuggerUrl"])
            for domain in ("Page", "Runtime", "Log"):
                tools.call(f"{domain}.enable")
            tools.call("Page.navigate", url=Path(path).resolve().as_uri())
            tools.wait_for("Page.loadEventFired")
            videos = tools.evaluate(VIDEOS_JS)
            images = tools.evaluate(IMAGES_JS)
            shot = tools.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
            tools.socket.close()
            return PageCheck(_errors(tools.events), videos, images, base64.b64decode(shot["data"]))
        finally:
            os.killpg(process.pid, signal.SIGKILL)  # all of it, before the profile is removed
            process.wait()


def _devtools_port(path: Path, process: subprocess.Popen) -> int:
    """The port Chromium wrote once it listens (it writes the file then). No clock of its own:
    a busy machine only makes it slower (pytest-timeout ends a hang)."""
    while not (path.is_file() and path.read_text().strip()):
        if process.poll() is not None:
            raise RuntimeError(f"chromium exited with {process.returncode} before listening")
        time.sleep(0.1)
    return int(path.read_text().split()[0])


def _errors(events: list[dict]) -> list[str]:
    found = []
    for event in events:
        method = event.get("method")
        params = event.get("params", {})
        if method == "Runtime.exceptionThrown":
            found.append(str(params["exceptionDetails"].get("text")))
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            found.append(str(params.get("args")))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            found.append(params["entry"].get("text", ""))
    return found
