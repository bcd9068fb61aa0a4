"""A worker whose link to the gateway dropped is not routed to (gateway/routing/router.py,
``KvRouter.link_lost``): the continuations of the requests it ran hold a prefix only it
cached, and its load hash outlives it by up to 3 s, so without this they went straight back
to its own stream and waited there for the takeover (its heartbeat TTL, 10 s): the chaos
soak's worker kill (issue 49)."""

from __future__ import annotations

import asyncio

from gateway.link_server import LinkService
from gateway.request_table import RequestTable
from gateway.routing.router import KvRouter
from gateway.routing.scoring import RouterConfig
from protos import link_pb2, queue_pb2


class _Context:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def invocation_metadata(self):
        return ()


async def _link(service: LinkService, worker_id: str, request_id: str | None, gone: asyncio.Event) -> None:
    """One worker's link: Hello, ``Accepted`` for ``request_id``, then it drops when ``gone`` is set."""
    async def messages():
        yield link_pb2.WorkerMessage(hello=link_pb2.Hello(worker_id=worker_id, model="m"))
        if request_id:
            yield link_pb2.WorkerMessage(accepted=link_pb2.Accepted(request_id=request_id, worker_id=worker_id))
        await gone.wait()
    async for _ in service.Connect(messages(), _Context()):
        pass


def test_a_worker_whose_link_dropped_is_not_routed_to_when_its_requests_are_requeued():
    async def scenario():
        router = KvRouter(None, RouterConfig())
        routable_when_requeued: list[list[str]] = []

        async def requeue(pending) -> None:  # the continuation policy: it routes right away
            routable_when_requeued.append(router._routable(["w1", "w2"]))

        async def nothing_queued(ticket) -> bool:
            return False

        table = RequestTable(nothing_queued, on_link_lost=requeue)
        service = LinkService(table, router=router)
        pending = table.register("r1")
        pending.message = queue_pb2.QueuedRequest(request_id="r1")
        gone, other = asyncio.Event(), asyncio.Event()
        links = [asyncio.ensure_future(_link(service, "w1", "r1", gone)),
                 asyncio.ensure_future(_link(service, "w2", None, other))]
        while len(service.sessions) < 2 or table.get("r1").session is None:
            await asyncio.sleep(0.01)
        assert router._routable(["w1", "w2"]) == ["w1", "w2"]
        gone.set()  # w1 dies: its link drops
        await links[0]
        assert routable_when_requeued == [["w2"]]  # r1's continuation could not go back to w1
        assert router._routable(["w1", "w2"]) == ["w2"]
        again = asyncio.Event()
        links.append(asyncio.ensure_future(_link(service, "w1", None, again)))  # it links again: routable
        while router._routable(["w1", "w2"]) != ["w1", "w2"]:
            await asyncio.sleep(0.01)
        other.set()
        again.set()
        await asyncio.gather(*links[1:])
        assert router._routable(["w1", "w2"]) == []

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_lost_link_is_forgotten_after_its_hold_and_a_second_link_keeps_the_worker():
    router = KvRouter(None, RouterConfig())
    router.link_lost("w1", hold_s=0.0)
    router.link_lost("", hold_s=60.0)  # a link that never said Hello: nobody to exclude
    assert router._routable(["w1", "w2"]) == ["w1", "w2"] and router._lost == {}

    async def scenario():
        service = LinkService(RequestTable(lambda ticket: asyncio.sleep(0, False)), router=router)
        first, second = asyncio.Event(), asyncio.Event()
        links = [asyncio.ensure_future(_link(service, "w1", None, first)),
                 asyncio.ensure_future(_link(service, "w1", None, second))]  # a reconnect racing the old link
        while len(service.sessions) < 2 or any(not s.worker_id for s in service.sessions):
            await asyncio.sleep(0.01)
        first.set()
        await links[0]
        assert router._routable(["w1"]) == ["w1"]  # its other link is up
        second.set()
        await links[1]
        assert router._routable(["w1"]) == []

    asyncio.run(asyncio.wait_for(scenario(), 30))
