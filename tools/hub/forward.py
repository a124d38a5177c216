"""Forward TCP connections from a listening socket this process inherited (--fd) to HOST:PORT.

The rehearsal's hub listens inside the virtual login node (tools/vcluster: a network namespace nothing outside can
reach). rehearsal.py opens the listening socket on this machine's loopback and starts this program *inside* the node
with it: connections accepted there come from this machine's browser, and the connections made here reach the hub's
proxy on the node's network. Plain bytes both ways, so websockets (the notebooks' kernels) pass too.
"""
import argparse
import asyncio
import contextlib
import socket


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError):
            writer.close()


async def serve(fd: int, host: str, port: int) -> None:
    async def connect(reader, writer):
        try:
            far_reader, far_writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
        except (OSError, asyncio.TimeoutError):
            writer.close()  # the browser sees a closed connection, as when the hub is down
            return
        await asyncio.gather(pipe(reader, far_writer), pipe(far_reader, writer))

    server = await asyncio.start_server(connect, sock=socket.socket(fileno=fd))
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--fd", type=int, required=True, help="the inherited listening socket")
    args.add_argument("host")
    args.add_argument("port", type=int)
    ns = args.parse_args()
    asyncio.run(serve(ns.fd, ns.host, ns.port))
