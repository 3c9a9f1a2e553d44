"""``pie:core/messaging``: push/pull queues and broadcast/subscribe topics between the
runs of one tenant (``inferlets.host.message_broker``: one broker per host, topics keyed
by the run's namespace, so two tenants never meet)."""

from __future__ import annotations

from typing import Any

from inferlets.host.binding import Interface, Resource, wit
from inferlets.host.pie_core.types import FutureString
from inferlets.host.wasi.poll import Pollable


class Subscription(Resource):
    WIT = ("pie:core/messaging", "subscription")

    def __init__(self, host: Any, sub: Any):
        self.sub = sub
        sub.on_message(host.waiter.wake)

    def close(self) -> None:
        self.sub.cancel()


class Messaging(Interface):
    NAME = "pie:core/messaging"
    RESOURCES = (Subscription,)

    def _topic(self, topic: str) -> str:
        return self.host.state.text(topic, "a topic")

    @wit("push")
    def push(self, topic: str, message: str) -> None:
        self.host.broker.push(
            self.host.namespace, self._topic(topic), self.host.state.text(message, "a message")
        )

    @wit("pull")
    def pull(self, topic: str) -> FutureString:
        return FutureString(self.host.broker.pull(self.host.namespace, self._topic(topic)), self.host)

    @wit("broadcast")
    def broadcast(self, topic: str, message: str) -> None:
        self.host.broker.broadcast(
            self.host.namespace, self._topic(topic), self.host.state.text(message, "a message")
        )

    @wit("subscribe")
    def subscribe(self, topic: str) -> Subscription:
        return Subscription(self.host, self.host.broker.subscribe(self.host.namespace, self._topic(topic)))

    @wit("[method]subscription.pollable")
    def sub_pollable(self, s: Subscription) -> Pollable:
        return Pollable(s.sub.has_message)

    @wit("[method]subscription.get")
    def sub_get(self, s: Subscription) -> str | None:
        return s.sub.next()

    @wit("[method]subscription.unsubscribe")
    def unsubscribe(self, s: Subscription) -> None:
        s.sub.cancel()
