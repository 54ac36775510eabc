"""What ``embodied deploy --record`` writes: each episode on the arm (or its twin) as its own
LeRobot dataset, the moment it ends."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embodied.schema import EnvSpec


@dataclass
class EpisodeRecorder:
    """Each episode written as a complete LeRobot dataset (``episode_NNNN/``) plus an mp4 per
    camera, as soon as it ends: a crash loses at most the episode in progress."""

    root: Path
    fps: float
    spec: EnvSpec
    robot_type: str
    # whether a judge scored success (the twin of a MuJoCo task); a real arm's episodes are not
    # judged, and their success column (all False) says nothing of them
    judged: bool = True
    count: int = 0

    def finish(self, result) -> Path | None:
        """Write the frames of an ended episode (robots.control.EpisodeResult)."""
        from embodied.dataset import LeRobotWriter
        from embodied.video import write_mp4

        frames = result.frames
        if not frames:
            return None
        out = self.root / f"episode_{self.count:04d}"
        self.count += 1
        cams = {c.name: (c.height, c.width) for c in self.spec.obs.cameras}
        # what the policy read besides the arm (a goal its user gave): SFT on the data needs it
        sizes = {k: int(np.prod(shape)) for k, shape in self.spec.obs.privileged.items()}
        writer = LeRobotWriter(
            out,
            fps=self.fps,
            cameras=cams,
            state_names=list(self.spec.obs.state_names),
            action_names=list(self.spec.action.names),
            privileged=sizes,
            robot_type=self.robot_type,
            # the commands sent: what SFT on the recording must act in
            source={"deploy": True, "action_space": self.spec.action.space},
        )
        T = len(frames)
        images = {c: np.stack([f["obs"].images[c][0].numpy() for f in frames]) for c in cams}
        t0 = frames[0]["t"]
        writer.add_episode(
            images=images,
            state=np.stack([f["obs"].state[0].numpy() for f in frames]),
            actions=np.stack([np.asarray(f["sent"], np.float32) for f in frames]),
            rewards=np.zeros(T, np.float32),
            success=np.asarray(result.successes, bool),  # the twin's judge after each action
            task=frames[0]["obs"].instruction[0],
            privileged={
                k: np.stack([f["obs"].privileged[k][0].numpy() for f in frames]) for k in sizes
            },
            extra={
                "end": result.reason,
                "wall_time_s": [round(f["t"] - t0, 4) for f in frames],
                "interventions": [",".join(f["interventions"]) for f in frames],
                "jitter_p99_ms": result.timing.get("jitter_p99_ms"),
                "success_judged": self.judged,
            },
        )
        writer.close()
        for c, video in images.items():
            write_mp4(out / f"{c}.mp4", list(video), self.fps)
        return out
