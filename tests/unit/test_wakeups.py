"""A busy event loop hears every finished gRPC operation in one turn (podium.wakeups).

Real gRPC, in processes of their own (a process's gRPC completion queue lives as long as its gRPC
objects, so a run here must not inherit one made before): a server whose loop is kept busy — each
turn blocks it 2 ms, as the API's handlers do — writes a few messages on each of hundreds of
streams at once. Each stream's writes go one after the other, so a loop that hears every finished
write in one turn needs a few turns per write; one that hears one a turn needs a turn for each of
the 1,200. Turns are counted, not time: the same on a slow machine and a fast one."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

STREAMS, WRITES = 300, 4

CLIENT = textwrap.dedent(
    """
    import asyncio, sys
    import grpc

    async def main(port, streams):
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(4)]
        calls = [channels[i % 4].unary_stream("/probe.P/Stream")(b"") for i in range(streams)]

        async def drain(call):
            async for _ in call:
                pass

        await asyncio.gather(*(drain(c) for c in calls))
        for c in channels:
            await c.close()

    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
    """
)

SERVER = textwrap.dedent(
    """
    import asyncio, json, subprocess, sys, time
    import grpc
    from podium.wakeups import drain_wakeups

    drained = sys.argv[1] == "drained" and drain_wakeups()
    STREAMS, WRITES, CLIENT = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

    async def main():
        opened, done, go = [], [], asyncio.Event()

        async def stream(request, context):
            opened.append(1)
            await go.wait()
            for i in range(WRITES):
                await context.write(b"x" * 16)
            done.append(1)

        handler = grpc.method_handlers_generic_handler(
            "probe.P", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = subprocess.Popen([sys.executable, "-c", CLIENT, str(port), str(STREAMS)])
        while len(opened) < STREAMS:  # every stream open before any write: the client's speed is not counted
            await asyncio.sleep(0.01)
        go.set()
        turns = 0
        while len(done) < STREAMS:
            time.sleep(0.002)  # the loop busy elsewhere, as a server's is with its API
            await asyncio.sleep(0)
            turns += 1
        await asyncio.get_running_loop().run_in_executor(None, client.wait)
        await server.stop(None)
        print(json.dumps({"drained": drained, "turns": turns, "client": client.returncode}))

    asyncio.run(main())
    """
)


def turns(mode: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", SERVER, mode, str(STREAMS), str(WRITES), CLIENT],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_a_busy_loop_hears_every_finished_write_in_one_turn() -> None:
    drained = turns("drained")
    assert drained["drained"] is True and drained["client"] == 0
    # each stream's four writes one after the other: a few turns each, whatever the 300 streams
    assert isinstance(drained["turns"], int) and drained["turns"] < 150, drained
    # the control: grpc's own wake-up socket, one byte read a turn, its writer blocked once ~280 wait
    plain = turns("plain")
    assert plain["drained"] is False and plain["client"] == 0
    assert isinstance(plain["turns"], int) and plain["turns"] > 400, (
        f"{plain}: grpc's own wake-up socket no longer holds a busy loop to a completion a turn; "
        "podium.wakeups may no longer be needed with this grpcio"
    )
