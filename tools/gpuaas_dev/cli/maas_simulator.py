"""`gpuaas maas-sim`: serve the MAAS 2.0 API simulator."""

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import err


def maas_sim(
    api_key: Annotated[
        str,
        typer.Option(
            "--api-key",
            envvar="GPUAAS_MAAS_API_KEY",
            show_default=False,
            help="The one key MAAS accepts (consumer:token:secret).",
        ),
    ],
    port: Annotated[int, typer.Option("--port", help="0 picks a free port.")] = 5240,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    machines: Annotated[Optional[int], typer.Option("--machines", help="Machine count (hostnames bm-01…).")] = None,
    machines_file: Annotated[
        Optional[Path],
        typer.Option("--machines-file", exists=True, dir_okay=False, help="JSON list of {system_id, hostname, tags}."),
    ] = None,
    deploy_seconds: Annotated[Optional[float], typer.Option("--deploy-seconds", help="Seconds a deploy takes.")] = None,
    release_seconds: Annotated[
        Optional[float], typer.Option("--release-seconds", help="Seconds a release takes.")
    ] = None,
    erase_seconds: Annotated[
        Optional[float], typer.Option("--erase-seconds", help="Seconds a disk erase takes.")
    ] = None,
    commission_seconds: Annotated[
        Optional[float], typer.Option("--commission-seconds", help="Seconds commissioning takes.")
    ] = None,
    testing_seconds: Annotated[
        Optional[float], typer.Option("--testing-seconds", help="Seconds hardware testing takes.")
    ] = None,
    custom_image: Annotated[
        Optional[list[str]], typer.Option("--custom-image", help="Uploaded custom image name (repeatable).")
    ] = None,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed of the random draws of injected faults, so a flaky run can be replayed.")
    ] = 0,
    ready_file: Annotated[
        Optional[Path], typer.Option("--ready-file", help="Written as JSON {service, pid, port, tls} once serving.")
    ] = None,
    tls_cert: Annotated[
        Optional[Path],
        typer.Option(
            "--tls-cert",
            exists=True,
            dir_okay=False,
            help="Serve HTTPS with this certificate (PEM; `gpuaas dev up` issues one from its CA). Without it and "
            "--tls-key: plain HTTP, which clients must accept by name (GPUAAS_MAAS_INSECURE_HTTP).",
        ),
    ] = None,
    tls_key: Annotated[
        Optional[Path], typer.Option("--tls-key", exists=True, dir_okay=False, help="The key of --tls-cert (PEM).")
    ] = None,
) -> None:
    """Serve the MAAS 2.0 API simulator until SIGTERM/Ctrl-C.

    Example: gpuaas maas-sim --api-key "$(gpuaas dev maas-key)" --port 0 --machines 2 --tls-cert sim.pem --tls-key
    sim-key.pem --ready-file sim.json"""
    from gpuaas_dev.maas_sim import SimConfig
    from gpuaas_dev.maas_sim import server as sim_server

    if machines is not None and machines_file is not None:
        raise typer.BadParameter("give --machines or --machines-file, not both")
    if (tls_cert is None) != (tls_key is None):
        raise typer.BadParameter("give --tls-cert and --tls-key together")
    try:
        config = SimConfig.from_cli(
            machines=machines if machines is not None else 4,
            api_key=api_key,
            machines_file=machines_file,
            deploy_seconds=deploy_seconds,
            release_seconds=release_seconds,
            erase_seconds=erase_seconds,
            commission_seconds=commission_seconds,
            testing_seconds=testing_seconds,
            seed=seed,
            custom_images=custom_image or None,
        )
    except ValueError as exc:
        err.print(f"[red]invalid simulator configuration[/]: {exc}")
        raise typer.Exit(2) from None

    try:
        tls = sim_server.tls_context(tls_cert, tls_key) if tls_cert and tls_key else None
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError: a key that is not the certificate's
        err.print(f"[red]cannot serve TLS with {tls_cert}[/]: {exc}")
        raise typer.Exit(2) from None

    async def serve() -> None:
        runner, actual = await sim_server.start(config, host, port, ssl_context=tls)
        if ready_file is not None:
            tmp = ready_file.with_suffix(".tmp")
            info = {"service": "maas-sim", "pid": os.getpid(), "port": actual, "tls": tls is not None}
            tmp.write_text(json.dumps(info))
            tmp.replace(ready_file)
        err.print(f"MAAS simulator at {'https' if tls else 'http'}://{host}:{actual}/MAAS/")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(serve())
