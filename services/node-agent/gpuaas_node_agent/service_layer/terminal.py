"""The slice terminal on the host: a `slice.terminal_open` task starts an SSH PTY into the allocation's guest
with the node-local relay key, and the agent relays it to the control plane over its own two terminal subjects.

The host never listens for anything: it asks. `node.terminal_output` carries what the guest wrote (one chunk
outstanding at a time, so a fast guest waits for the control plane instead of flooding it) and
`node.terminal_input` asks for the tenant's keystrokes past those written; both are requests answered on the
host's own inbox, so the host account needs no subscription but its inbox and reaches no other host's session.
Offsets make a lost reply harmless: the same bytes asked for again are sent again and counted once.

The target comes from the host's own record of the VM it provisioned (its address, and the host key its seed
planted, checked by ssh), never from the task: a task cannot aim the relay key at another machine.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gpuaas_common.bus import HandlerContext, PermanentError
from gpuaas_common.contract import messages as m
from gpuaas_common.contract import utcnow
from gpuaas_common.logging import get_logger

from ..adapters import guest_ssh
from ..adapters.state_store import StateStore
from ..adapters.terminal_ssh import SshPty, TerminalSshError

log = get_logger(__name__)

# One request outstanding per direction; the control plane holds an input request up to its own hold (10 s by
# default) before it answers empty, so a wait past this means nobody is answering.
INPUT_WAIT_S = 30.0
OUTPUT_WAIT_S = 10.0
# Consecutive unanswered requests before the host gives the session up (the control plane's replica that held it
# is gone; the tenant reconnects and gets a new session).
MAX_UNANSWERED = 3

Ask = Callable[[str, m.Payload, float], Awaitable[Any]]
OpenPty = Callable[..., Awaitable[SshPty]]


class ControlPlaneGone(Exception):
    pass


class TerminalRefused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TerminalRelay:
    def __init__(
        self,
        node_id: str,
        store: StateStore,
        seed_dir: Path,
        relay_key: Path,
        guest_user: str,
        ssh_port: int,
        ask: Ask,
        *,
        open_pty: OpenPty = SshPty.open,
    ) -> None:
        self.node_id = node_id
        self.store = store
        self.seed_dir = seed_dir
        self.relay_key = relay_key
        self.guest_user = guest_user
        self.ssh_port = ssh_port
        self._ask = ask
        self._open_pty = open_pty
        self._sessions: dict[str, asyncio.Task[None]] = {}

    # --- bus entry ------------------------------------------------------------------------------------

    async def on_open(self, ctx: HandlerContext) -> None:
        task: m.SliceTerminalOpen = ctx.payload
        if task.node_id != self.node_id:
            raise PermanentError("schema_invalid", f"task for {task.node_id} delivered to {self.node_id}")
        session = str(task.session_id)
        if session in self._sessions:
            return  # a redelivery of a session already relaying
        # The session outlives the task message: it is acknowledged now, and the session runs until one side ends.
        run = asyncio.create_task(self.relay(task), name=f"terminal-{session}")
        self._sessions[session] = run
        run.add_done_callback(lambda _t: self._sessions.pop(session, None))

    async def stop(self) -> None:
        for run in list(self._sessions.values()):
            run.cancel()
        for run in list(self._sessions.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await run

    # --- one session ----------------------------------------------------------------------------------

    def target(self, task: m.SliceTerminalOpen) -> tuple[str, str]:
        """(guest IP, planted host key's public line) of the allocation's running guest on this host."""
        guest = self.store.running_guest(str(task.allocation_id))
        if guest is None:
            raise TerminalRefused(f"no running slice guest of allocation {task.allocation_id} on {self.node_id}")
        slots = guest["payload"].get("slots") or []
        if not slots or not slots[0].get("private_ip"):
            raise TerminalRefused(f"the record of {guest['vm_name']} names no guest address")
        key_file = self.seed_dir / f"{guest['vm_name']}.hostkey"
        try:
            host_key = guest_ssh.HostKey.from_private(key_file.read_text())
        except (OSError, guest_ssh.GuestSshError) as exc:
            raise TerminalRefused(f"the host key planted in {guest['vm_name']} is not readable: {exc}") from exc
        return str(slots[0]["private_ip"]), host_key.public_line

    async def relay(self, task: m.SliceTerminalOpen) -> None:
        ids = {"session_id": str(task.session_id), "allocation_id": str(task.allocation_id), "task_id": task.task_id}
        out = _Output(self, task)
        try:
            ip, host_key = self.target(task)
            pty = await self._open_pty(
                ip, self.ssh_port, self.guest_user, self.relay_key, host_key, cols=task.cols, rows=task.rows
            )
        except (TerminalRefused, TerminalSshError) as exc:
            reason = exc.reason if isinstance(exc, TerminalRefused) else str(exc)
            log.warning("terminal_refused", **ids, reason=reason)
            with contextlib.suppress(ControlPlaneGone):
                await out.end("refused" if isinstance(exc, TerminalRefused) else "ssh_failed", reason)
            return
        log.info("terminal_opened", **ids, guest_ip=ip, pid=pty.pid)
        typed = 0
        ended, detail = "guest_closed", None
        remaining = (task.deadline - utcnow()).total_seconds()
        pump_in = asyncio.create_task(self._pump_input(task, pty, out))
        try:
            async with asyncio.timeout(max(remaining, 0.0)):
                while True:
                    chunk = await pty.read(m.TERMINAL_CHUNK_MAX)
                    if not chunk:
                        break
                    if not await out.send(chunk):
                        ended = "client_closed"
                        break
        except TimeoutError:
            ended, detail = "deadline", "the session reached its deadline"
        except ControlPlaneGone:
            ended = "agent_gone"
        finally:
            pump_in.cancel()
            with contextlib.suppress(asyncio.CancelledError, ControlPlaneGone):
                typed = await pump_in
            rc = await pty.close()
        if out.closed_by_control_plane:
            ended = "client_closed"
        if not out.closed_by_control_plane and ended != "agent_gone":
            with contextlib.suppress(ControlPlaneGone):
                await out.end(ended, detail, exit_status=rc)
        log.info("terminal_closed", **ids, end=ended, exit_status=rc, bytes_out=out.offset, bytes_in=typed)

    async def _pump_input(self, task: m.SliceTerminalOpen, pty: SshPty, out: _Output) -> int:
        """Write the tenant's keystrokes to the guest until the control plane closes the session; returns the
        bytes written."""
        received = 0
        unanswered = 0
        while True:
            ask = m.NodeTerminalInput(session_id=task.session_id, node_id=self.node_id, received=received)
            try:
                reply: m.TerminalInput = await self._ask("node.terminal_input", ask, INPUT_WAIT_S)
            except TimeoutError:
                unanswered += 1
                if unanswered >= MAX_UNANSWERED:
                    raise ControlPlaneGone() from None
                continue
            unanswered = 0
            data = base64.b64decode(reply.data)
            skip = received - reply.offset
            if skip < 0:
                # Bytes the host never got would be lost silently: the session cannot go on faithfully.
                log.warning("terminal_input_gap", session_id=str(task.session_id), received=received, at=reply.offset)
                await pty.close()
                return received
            if len(data) > skip:
                await pty.write(data[skip:])
                received += len(data) - skip
            if reply.status == "closed":
                out.closed_by_control_plane = True
                await pty.close()  # the output side reads the end and stops
                return received


class _Output:
    """The guest's bytes to the control plane, one chunk outstanding, from `offset`."""

    def __init__(self, relay: TerminalRelay, task: m.SliceTerminalOpen) -> None:
        self.relay, self.task = relay, task
        self.offset = 0
        self.closed_by_control_plane = False

    async def _post(self, msg: m.NodeTerminalOutput) -> m.TerminalOutputAck:
        for _ in range(MAX_UNANSWERED):
            try:
                ack: m.TerminalOutputAck = await self.relay._ask("node.terminal_output", msg, OUTPUT_WAIT_S)
                return ack
            except TimeoutError:
                continue
        raise ControlPlaneGone()

    async def send(self, chunk: bytes) -> bool:
        """False once the control plane has closed the session."""
        msg = m.NodeTerminalOutput(
            session_id=self.task.session_id,
            node_id=self.relay.node_id,
            offset=self.offset,
            data=base64.b64encode(chunk).decode(),
        )
        ack = await self._post(msg)
        self.offset += len(chunk)
        if ack.status == "closed":
            self.closed_by_control_plane = True
            return False
        return True

    async def end(self, reason: str, detail: str | None, *, exit_status: int | None = None) -> None:
        msg = m.NodeTerminalOutput(
            session_id=self.task.session_id,
            node_id=self.relay.node_id,
            offset=self.offset,
            eof=True,
            exit_status=exit_status,
            reason=reason,  # type: ignore[arg-type]  # TerminalSessionEnd's values
            detail=(detail or "")[:512] or None,
        )
        await self._post(msg)
