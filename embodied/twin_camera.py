"""The digital twin's cameras (embodied/twin.py): LeRobot ``Camera``s whose frames MuJoCo renders
from the twin's scene, on a capture thread as a real camera's driver captures. twin.py imports
it when it builds a twin, MUJOCO_GL set by then."""

import threading
import time

import mujoco
import numpy as np
from lerobot.cameras import Camera, CameraConfig


class TwinCamera(Camera):
    """A LeRobot camera whose frames the twin renders on a capture thread at ``fps``, as a
    real camera's driver captures in the background: ``read_latest`` never waits for a
    render."""

    def __init__(self, twin, camera: str, width: int, height: int, fps: int):  # twin: ArmTwin
        cfg = CameraConfig.__new__(CameraConfig)
        cfg.fps = fps
        cfg.width = width
        cfg.height = height
        super().__init__(cfg)
        self.twin = twin
        self.camera = camera
        self._frame = None
        self._thread = None
        self._stop = threading.Event()
        self._fresh = threading.Event()  # a frame, or the error that ended the capture thread
        self._error: BaseException | None = None

    @property
    def is_connected(self) -> bool:
        """Connected and not yet disconnected, as LeRobot's OpenCV camera has it (a capture
        thread that died is ``read_latest``'s error, not a robot that never connected)."""
        return self._thread is not None

    @staticmethod
    def find_cameras() -> list:
        return []

    def connect(self, warmup: bool = True) -> None:
        self._stop.clear()
        self._error = None
        self._thread = threading.Thread(
            target=self._capture, daemon=True, name=f"twin-camera-{self.camera}"
        )
        self._thread.start()
        if warmup and not self._fresh.wait(30):
            raise TimeoutError(f"twin camera {self.camera}: no frame within 30 s")
        self._raise_if_failed()

    def _capture(self) -> None:
        """Render frames until told to stop; an error (a renderer that cannot start: no EGL)
        is kept for the reads to raise, rather than a thread's traceback and a timeout."""
        try:
            self._render_frames()
        except Exception as error:
            self._error = error
            self._fresh.set()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"twin camera {self.camera}: {self._error}") from self._error

    def _render_frames(self) -> None:
        with self.twin._lock:  # the GL context belongs to this thread
            vis = self.twin.model.vis.global_
            vis.offwidth = max(vis.offwidth, self.width)
            vis.offheight = max(vis.offheight, self.height)
            renderer = mujoco.Renderer(self.twin.model, self.height, self.width)
        try:
            while not self._stop.is_set():
                t0 = time.monotonic()
                # a consistent snapshot of the scene; rendering it needs no lock
                with self.twin._lock:
                    self.twin.advance()
                    renderer.update_scene(self.twin.data, camera=self.camera)
                self._frame = renderer.render().copy()  # uint8 [H, W, 3]
                self._fresh.set()
                self._stop.wait(max(0.0, 1.0 / self.fps - (time.monotonic() - t0)))
        finally:
            renderer.close()

    def read(self) -> np.ndarray:
        return self.async_read(1000)

    def async_read(self, timeout_ms: float = 200) -> np.ndarray:
        self._raise_if_failed()  # (before the clear: the failure set the event)
        self._fresh.clear()
        if not self._fresh.wait(timeout_ms / 1e3):
            raise TimeoutError(f"twin camera {self.camera}: no new frame within {timeout_ms} ms")
        self._raise_if_failed()
        return self._frame

    def read_latest(self, max_age_ms: int = 500) -> np.ndarray:
        """The last frame, as LeRobot's OpenCV camera gives it, but for its age: the twin's
        renders keep no wall-clock pace a test could rely on."""
        self._raise_if_failed()
        if self._thread is None or not self._thread.is_alive():  # (its last frame is stale)
            raise RuntimeError(f"twin camera {self.camera}: its capture thread is not running")
        if self._frame is None:
            raise RuntimeError(f"twin camera {self.camera}: no frame captured yet")
        return self._frame

    def disconnect(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._thread = None
