"""A serial port with Feetech STS servos behind it, in software: the test double of an SO-100/SO-101
arm's motor bus, and the wire through which the digital twin is driven.

LeRobot's own driver stack runs unchanged on top of it (``SOFollower`` -> ``FeetechMotorsBus`` ->
``scservo_sdk``): only the pyserial object under the SDK's ``PortHandler`` is replaced. The port
parses Feetech protocol-0 instruction packets (ping, read, write, sync read, sync write), keeps a
register map per servo, answers with status packets, and logs every command written, so tests can
assert the exact goal positions that reached the "motors".

Where the servos move to is up to a ``ServoPhysics`` (the MuJoCo twin, embodied/twin.py): the port
hands it goal positions and torque switches and asks it for present positions, in encoder ticks.
Without one, present positions follow goals at once (ideal servos).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

# Feetech STS control table (addresses and sizes, as in LeRobot's feetech/tables.py)
FIRMWARE_MAJOR, FIRMWARE_MINOR, MODEL_NUMBER = 0, 1, 3
MIN_POSITION_LIMIT, MAX_POSITION_LIMIT, HOMING_OFFSET = 9, 11, 31
TORQUE_ENABLE, GOAL_POSITION, LOCK, PRESENT_POSITION = 40, 42, 55, 56
STS3215_MODEL = 777
TICKS_PER_TURN = 4096
INST_PING, INST_READ, INST_WRITE, INST_SYNC_READ, INST_SYNC_WRITE = 0x01, 0x02, 0x03, 0x82, 0x83
BROADCAST = 0xFE


def rad_to_ticks(rad: float) -> int:
    """Encoder ticks of a joint angle, 0 rad at mid-turn (2048)."""
    return int(round(TICKS_PER_TURN / 2 + rad * TICKS_PER_TURN / (2 * math.pi)))


def ticks_to_rad(ticks: int) -> float:
    return (ticks - TICKS_PER_TURN / 2) * 2 * math.pi / TICKS_PER_TURN


class ServoPhysics(Protocol):
    """What moves the servos: goals and torque in, positions out (ticks, by servo id)."""

    def command(self, goals: dict[int, int], torque: dict[int, bool]) -> None: ...
    def positions(self) -> dict[int, int]: ...


@dataclass
class Command:
    """One register write that reached the bus."""

    t: float  # time.monotonic() when written
    servo: int
    address: int
    value: int  # little-endian value of the written bytes


@dataclass
class Servo:
    id: int
    regs: bytearray = field(default_factory=lambda: bytearray(128))

    def get(self, address: int, size: int) -> int:
        return int.from_bytes(self.regs[address:address + size], "little")

    def set(self, address: int, size: int, value: int) -> None:
        self.regs[address:address + size] = int(value).to_bytes(size, "little")


def _checksum(body: bytes | bytearray) -> int:
    return ~sum(body) & 0xFF


class FeetechPort:
    """A pyserial-like object (``write``, ``read``, ``in_waiting``, ``flush``, ``close``) with servos
    behind it. ``ranges`` gives each servo id its calibrated (min, max) ticks, written into its
    limit registers as LeRobot's calibration does, with homing offset 0."""

    def __init__(self, ranges: dict[int, tuple[int, int]], physics: ServoPhysics | None = None):
        self.servos = {i: Servo(i) for i in ranges}
        for i, (lo, hi) in ranges.items():
            s = self.servos[i]
            s.set(FIRMWARE_MAJOR, 1, 3), s.set(FIRMWARE_MINOR, 1, 10), s.set(MODEL_NUMBER, 2, STS3215_MODEL)
            s.set(5, 1, i)  # ID register
            s.set(MIN_POSITION_LIMIT, 2, lo), s.set(MAX_POSITION_LIMIT, 2, hi)
            s.set(PRESENT_POSITION, 2, (lo + hi) // 2), s.set(GOAL_POSITION, 2, (lo + hi) // 2)
        self.physics = physics
        if physics is not None:  # a powered-up servo's goal is where it stands
            for i, ticks in physics.positions().items():
                self.servos[i].set(PRESENT_POSITION, 2, ticks), self.servos[i].set(GOAL_POSITION, 2, ticks)
        self.log: list[Command] = []  # every register write, in order
        self.is_open, self.unplugged = True, False  # unplugged: the bus stops answering (a cut cable)
        self._rx = bytearray()
        self._lock = threading.Lock()

    # --- what tests and the twin read ------------------------------------------------------
    def goal_writes(self) -> list[dict[int, int]]:
        """Goal positions (ticks by servo id) of every write of Goal_Position, in order; a sync
        write of several servos is one entry."""
        out, last_t = [], None
        for c in self.log:
            if c.address == GOAL_POSITION:
                if c.t != last_t:
                    out.append({})
                out[-1][c.servo], last_t = c.value, c.t
        return out

    def torque(self) -> dict[int, bool]:
        return {i: bool(s.get(TORQUE_ENABLE, 1)) for i, s in self.servos.items()}

    # --- pyserial surface used by scservo_sdk.PortHandler -----------------------------------
    @property
    def in_waiting(self) -> int:
        return len(self._rx)

    def reset_input_buffer(self) -> None:
        self._rx.clear()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.is_open = False

    def read(self, size: int = 1) -> bytes:
        with self._lock:
            out = bytes(self._rx[:size])
            del self._rx[:size]
            return out

    def write(self, data) -> int:
        packet = bytes(data)
        with self._lock:
            if not self.unplugged:
                self._handle(packet)
        return len(packet)

    # --- protocol ---------------------------------------------------------------------------
    def _status(self, servo: int, params: bytes = b"") -> None:
        body = bytes([servo, len(params) + 2, 0]) + params
        self._rx += b"\xff\xff" + body + bytes([_checksum(body)])

    def _sync_physics(self) -> None:
        if self.physics is not None:
            for i, ticks in self.physics.positions().items():
                self.servos[i].set(PRESENT_POSITION, 2, ticks)

    def _written(self, servo: int, address: int, data: bytes, now: float) -> bool:
        """Store a write; True when it touched a goal position or a torque switch."""
        s = self.servos[servo]
        s.regs[address:address + len(data)] = data
        touched = False
        for a, size in ((TORQUE_ENABLE, 1), (GOAL_POSITION, 2), (LOCK, 1)):
            if address <= a < address + len(data):
                self.log.append(Command(now, servo, a, s.get(a, size)))
                touched |= a != LOCK
        if self.physics is None and address <= GOAL_POSITION < address + len(data):
            s.set(PRESENT_POSITION, 2, s.get(GOAL_POSITION, 2))  # ideal servo
        return touched

    def _command_physics(self) -> None:
        if self.physics is not None:
            self.physics.command({i: v.get(GOAL_POSITION, 2) for i, v in self.servos.items()}, self.torque())

    def _handle(self, packet: bytes) -> None:
        if len(packet) < 6 or packet[:2] != b"\xff\xff" or packet[-1] != _checksum(packet[2:-1]):
            return  # a corrupt packet gets no answer, as on a real bus
        servo, inst, params, now = packet[2], packet[4], packet[5:-1], time.monotonic()
        if inst == INST_SYNC_WRITE:
            address, size, touched = params[0], params[1], False
            for k in range(2, len(params), size + 1):
                if params[k] in self.servos:
                    touched |= self._written(params[k], address, bytes(params[k + 1:k + 1 + size]), now)
            if touched:
                self._command_physics()
            return
        if inst == INST_SYNC_READ:
            address, size = params[0], params[1]
            self._sync_physics()
            for i in params[2:]:
                if i in self.servos:
                    self._status(i, bytes(self.servos[i].regs[address:address + size]))
            return
        if servo not in self.servos:
            return  # nobody answers
        if inst == INST_PING:
            self._status(servo)
        elif inst == INST_READ:
            if params[0] <= PRESENT_POSITION < params[0] + params[1]:
                self._sync_physics()
            self._status(servo, bytes(self.servos[servo].regs[params[0]:params[0] + params[1]]))
        elif inst == INST_WRITE:
            if self._written(servo, params[0], bytes(params[1:]), now):
                self._command_physics()
            self._status(servo)


def attach(bus, port: FeetechPort) -> None:
    """Make LeRobot's ``FeetechMotorsBus`` talk to ``port`` instead of a serial device: its
    PortHandler opens ``port`` where it would open /dev/tty*."""
    handler = bus.port_handler

    def setup_port(cflag_baud):  # the SDK's PortHandler.setupPort, minus serial.Serial(...)
        handler.ser, handler.is_open = port, True
        port.is_open = True
        handler.tx_time_per_byte = (1000.0 / handler.baudrate) * 10.0
        return True

    handler.setupPort = setup_port
