"""A serial port with servos behind it, in software: the test double of an arm's motor bus, and
the wire through which the digital twin is driven. ``FeetechPort``: Feetech STS servos, protocol 0
(SO-100/SO-101). ``DynamixelPort``: Dynamixel X-series servos, protocol 2.0 (Koch).

LeRobot's own driver stack runs unchanged on top of it (``SOFollower`` -> ``FeetechMotorsBus`` ->
``scservo_sdk``, or ``KochFollower`` -> ``DynamixelMotorsBus`` -> ``dynamixel_sdk``): only the
pyserial object under the SDK's ``PortHandler`` is replaced. The port parses instruction packets
(ping, read, write, sync read, sync write), keeps a register map per servo, answers with status
packets, and logs every command written, so tests can assert the exact goal positions that reached
the "motors".

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

TICKS_PER_TURN = 4096
INST_PING = 0x01
INST_READ = 0x02
INST_WRITE = 0x03
INST_SYNC_READ = 0x82
INST_SYNC_WRITE = 0x83


@dataclass(frozen=True)
class Table:
    """Where a servo family keeps what the port needs: (address, size) in its control table (as in
    LeRobot's feetech/tables.py and dynamixel/tables.py)."""

    model: tuple[int, int]
    firmware: tuple[int, int]
    min_limit: tuple[int, int]
    max_limit: tuple[int, int]
    torque: tuple[int, int]
    goal: tuple[int, int]
    present: tuple[int, int]
    lock: tuple[int, int] | None = None
    model_number: int = 0


FEETECH_STS = Table(
    model=(3, 2),
    firmware=(0, 1),
    min_limit=(9, 2),
    max_limit=(11, 2),
    torque=(40, 1),
    goal=(42, 2),
    present=(56, 2),
    lock=(55, 1),
    model_number=777,
)  # STS3215
DYNAMIXEL_X = Table(
    model=(0, 2),
    firmware=(6, 1),
    min_limit=(52, 4),
    max_limit=(48, 4),
    torque=(64, 1),
    goal=(116, 4),
    present=(132, 4),
    model_number=1060,
)  # XL430-W250 (the Koch's XL330s differ only in the number)


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
    regs: bytearray = field(default_factory=lambda: bytearray(256))  # covers both control tables

    def get(self, address: int, size: int) -> int:
        return int.from_bytes(self.regs[address : address + size], "little")

    def set(self, address: int, size: int, value: int) -> None:
        self.regs[address : address + size] = int(value).to_bytes(size, "little")


def _checksum(body: bytes | bytearray) -> int:
    return ~sum(body) & 0xFF


class ServoPort:
    """A pyserial-like object (``write``, ``read``, ``in_waiting``, ``flush``, ``close``) with
    servos behind it. ``ranges`` gives each servo id its calibrated (min, max) ticks, written into
    its limit registers as LeRobot's calibration does, with homing offset 0. Subclasses speak a
    wire protocol (``_handle`` an instruction packet, ``_status`` an answer)."""

    table: Table

    def __init__(
        self,
        ranges: dict[int, tuple[int, int]],
        physics: ServoPhysics | None = None,
        model_numbers: dict[int, int] | None = None,
    ):
        t = self.table
        self.servos = {i: Servo(i) for i in ranges}
        for i, (lo, hi) in ranges.items():
            s = self.servos[i]
            s.set(*t.model, (model_numbers or {}).get(i, t.model_number))
            s.set(*t.firmware, 10)
            s.set(*t.min_limit, lo)
            s.set(*t.max_limit, hi)
            s.set(*t.present, (lo + hi) // 2)
            s.set(*t.goal, (lo + hi) // 2)
        self.physics = physics
        if physics is not None:  # a powered-up servo's goal is where it stands
            for i, ticks in physics.positions().items():
                self.servos[i].set(*t.present, ticks)
                self.servos[i].set(*t.goal, ticks)
        self.log: list[Command] = []  # every write of a torque switch, a goal or a lock, in order
        self.is_open = True
        self.unplugged = False  # True: the bus stops answering (a cut cable)
        self._rx = bytearray()
        self._lock = threading.Lock()

    # --- what tests and the twin read ------------------------------------------------------
    def goal_writes(self) -> list[dict[int, int]]:
        """Goal positions (ticks by servo id) of every write of Goal_Position, in order; a sync
        write of several servos is one entry."""
        out = []
        last_t = None
        for c in self.log:
            if c.address == self.table.goal[0]:
                if c.t != last_t:
                    out.append({})
                out[-1][c.servo] = c.value
                last_t = c.t
        return out

    def torque(self) -> dict[int, bool]:
        return {i: bool(s.get(*self.table.torque)) for i, s in self.servos.items()}

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

    # --- the register model, whatever the wire ---------------------------------------------
    def _sync_physics(self) -> None:
        if self.physics is not None:
            for i, ticks in self.physics.positions().items():
                self.servos[i].set(*self.table.present, ticks)

    def _written(self, servo: int, address: int, data: bytes, now: float) -> bool:
        """Store a write; True when it touched a goal position or a torque switch."""
        t = self.table
        s = self.servos[servo]
        s.regs[address : address + len(data)] = data
        touched = False
        for reg in (t.torque, t.goal, t.lock):
            if reg is not None and address <= reg[0] < address + len(data):
                self.log.append(Command(now, servo, reg[0], s.get(*reg)))
                touched |= reg != t.lock
        if self.physics is None and address <= t.goal[0] < address + len(data):
            s.set(*t.present, s.get(*t.goal))  # ideal servo
        return touched

    def _command_physics(self) -> None:
        if self.physics is not None:
            self.physics.command(
                {i: v.get(*self.table.goal) for i, v in self.servos.items()}, self.torque()
            )

    def _read(self, servo: int, address: int, size: int) -> bytes:
        if address <= self.table.present[0] < address + size:
            self._sync_physics()
        return bytes(self.servos[servo].regs[address : address + size])

    def _sync_write(
        self, address: int, size: int, entries: bytes, now: float, id_size: int = 1
    ) -> None:
        touched = False
        for k in range(0, len(entries), size + id_size):
            servo = entries[k]
            if servo in self.servos:
                touched |= self._written(
                    servo, address, bytes(entries[k + id_size : k + id_size + size]), now
                )
        if touched:
            self._command_physics()

    def _status(self, servo: int, params: bytes = b"") -> None:
        raise NotImplementedError

    def _handle(self, packet: bytes) -> None:
        raise NotImplementedError


class FeetechPort(ServoPort):
    """Feetech STS servos, protocol 0: FF FF ID LEN INST PARAMS CHECKSUM, little-endian values."""

    table = FEETECH_STS

    def _status(self, servo: int, params: bytes = b"") -> None:
        body = bytes([servo, len(params) + 2, 0]) + params
        self._rx += b"\xff\xff" + body + bytes([_checksum(body)])

    def _handle(self, packet: bytes) -> None:
        if len(packet) < 6 or packet[:2] != b"\xff\xff" or packet[-1] != _checksum(packet[2:-1]):
            return  # a corrupt packet gets no answer, as on a real bus
        servo = packet[2]
        inst = packet[4]
        params = packet[5:-1]
        now = time.monotonic()
        if inst == INST_SYNC_WRITE:
            self._sync_write(params[0], params[1], params[2:], now)
        elif inst == INST_SYNC_READ:
            for i in params[2:]:
                if i in self.servos:
                    self._status(i, self._read(i, params[0], params[1]))
        elif servo not in self.servos:
            return  # nobody answers
        elif inst == INST_PING:
            self._status(servo)
        elif inst == INST_READ:
            self._status(servo, self._read(servo, params[0], params[1]))
        elif inst == INST_WRITE:
            if self._written(servo, params[0], bytes(params[1:]), now):
                self._command_physics()
            self._status(servo)


class DynamixelPort(ServoPort):
    """Dynamixel X-series servos, protocol 2.0: FF FF FD 00 ID LEN(2) INST PARAMS CRC(2), byte
    stuffing after FF FF FD, CRC-16 as the Robotis SDK computes it."""

    table = DYNAMIXEL_X

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from dynamixel_sdk.protocol2_packet_handler import Protocol2PacketHandler

        self._sdk = (
            Protocol2PacketHandler()
        )  # its CRC and byte stuffing, so both ends agree by construction

    def _status(self, servo: int, params: bytes = b"") -> None:
        n = len(params) + 4  # instruction, error, CRC
        packet = [0xFF, 0xFF, 0xFD, 0x00, servo, n & 0xFF, n >> 8, 0x55, 0x00, *params, 0, 0]
        packet = self._sdk.addStuffing(packet)
        crc = self._sdk.updateCRC(0, packet, len(packet) - 2)
        packet[-2:] = [crc & 0xFF, crc >> 8]
        self._rx += bytes(packet)

    def _handle(self, packet: bytes) -> None:
        if len(packet) < 10 or packet[:4] != b"\xff\xff\xfd\x00":
            return
        if self._sdk.updateCRC(0, list(packet), len(packet) - 2) != int.from_bytes(
            packet[-2:], "little"
        ):
            return  # a corrupt packet gets no answer
        p = bytes(self._sdk.removeStuffing(list(packet)))
        n = int.from_bytes(p[5:7], "little")
        servo = p[4]
        inst = p[7]
        params = p[8 : 8 + n - 3]
        now = time.monotonic()
        word = lambda b: int.from_bytes(b, "little")  # noqa: E731
        if inst == INST_SYNC_WRITE:
            self._sync_write(word(params[0:2]), word(params[2:4]), params[4:], now)
        elif inst == INST_SYNC_READ:
            for i in params[4:]:
                if i in self.servos:
                    self._status(i, self._read(i, word(params[0:2]), word(params[2:4])))
        elif servo not in self.servos:
            return
        elif inst == INST_PING:
            s = self.servos[servo]
            self._status(servo, bytes(s.regs[0:2]) + bytes(s.regs[6:7]))  # model number, firmware
        elif inst == INST_READ:
            self._status(servo, self._read(servo, word(params[0:2]), word(params[2:4])))
        elif inst == INST_WRITE:
            if self._written(servo, word(params[0:2]), bytes(params[2:]), now):
                self._command_physics()
            self._status(servo)


def attach(bus, port: ServoPort) -> None:
    """Make a LeRobot motor bus (Feetech or Dynamixel) talk to ``port`` instead of a serial device:
    its SDK's PortHandler opens ``port`` where it would open /dev/tty*."""
    handler = bus.port_handler

    def setup_port(cflag_baud):  # the SDK's PortHandler.setupPort, minus serial.Serial(...)
        handler.ser = port
        handler.is_open = True
        port.is_open = True
        handler.tx_time_per_byte = (1000.0 / handler.baudrate) * 10.0
        return True

    handler.setupPort = setup_port
