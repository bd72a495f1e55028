"""Where a webhook may be sent: ``check_destination``, an allow-list of globally routable unicast
addresses (docs/api.md, "Webhooks"), checked at create and again before each attempt, on the
addresses of then."""
from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable
from contextlib import suppress
from urllib.parse import urlsplit

from llm_batch.core.config import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], list[str]]

_GLOBAL_UNICAST_V6 = ipaddress.ip_network("2000::/3")
# Refused whatever ``is_global`` says (it varies with the Python release): IPv6 ranges that
# can carry an IPv4 address, and IPv4 ones IANA lists as not global that Python 3.11 calls global.
_REFUSED = {
    ipaddress.ip_network(net): name for net, name in {
        "2002::/16": "6to4", "64:ff9b::/96": "NAT64", "64:ff9b:1::/48": "local-use NAT64",
        "::ffff:0:0/96": "IPv4-mapped", "2001::/32": "Teredo", "fec0::/10": "site-local",
        "192.0.0.0/24": "IETF protocol assignment", "192.88.99.0/24": "6to4 relay anycast",
    }.items()
}
# What inet_aton reads as an IPv4 address (127.1, 2130706433, 0x7f.0.0.1, 0177.0.0.1): such a
# host is an address, never a name to look up.
_NUMERIC_V4 = re.compile(r"[0-9a-fx.]+")
_NAME = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)(\.(?!-)[a-z0-9_-]{1,63}(?<!-))*")


class DestinationRefused(ValueError):
    """A webhook URL that may not be called; the message names the URL and why."""


def _allowed(entries: Iterable[str]) -> tuple[set[str], list[ipaddress.IPv4Network | ipaddress.IPv6Network]]:
    """The admin's ``webhook_allowed_hosts``: host names, and networks (an address is a /32 or /128)."""
    names, networks = set(), []
    for entry in entries:
        text = entry.strip().strip("[]").lower()
        if not text:
            continue
        try:
            networks.append(ipaddress.ip_network(text, strict=False))
        except ValueError:
            names.add(text.rstrip("."))
    return names, networks


def refusal(ip: IPAddress) -> str | None:
    """Why `ip` is not a webhook destination by default; None when it is one."""
    if ip == ipaddress.ip_address("169.254.169.254") or ip == ipaddress.ip_address("fd00:ec2::254"):
        return "the cloud metadata address"
    for network, name in _REFUSED.items():
        if ip.version == network.version and ip in network:
            return f"a {name} address"
    for kind in ("loopback", "link_local", "private", "multicast", "unspecified", "reserved"):
        if getattr(ip, f"is_{kind}"):
            return f"a {kind.replace('_', '-')} address"
    if ip.version == 6 and ip not in _GLOBAL_UNICAST_V6:
        return "not a global unicast address"
    return None if ip.is_global else "not a public address"


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def _literal(host: str, bracketed: bool) -> IPAddress | None:
    """The address `host` spells, if any; ValueError if it looks like one but is none."""
    if bracketed or ":" in host:
        if "%" in host:
            raise ValueError("a zone id names an interface of this machine")
        return ipaddress.IPv6Address(host)
    if _NUMERIC_V4.fullmatch(host):
        with suppress(OSError):
            return ipaddress.IPv4Address(socket.inet_aton(host))
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def check_destination(url: str, settings: Settings, resolve: Resolver | None = system_resolver, *,
                      unresolved_ok: bool = False) -> list[str]:
    """The addresses `url` may be sent to, or DestinationRefused. ``resolve=None`` checks only
    what the URL says; ``unresolved_ok``: a name that does not resolve now passes (at create)."""
    shown = url if len(url) <= 200 else url[:200] + "..."

    def refuse(why: str) -> DestinationRefused:
        return DestinationRefused(f"webhook URL {shown!r} {why}")

    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise refuse(f"is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise refuse("is refused: only http:// and https:// URLs are allowed")
    if not parts.hostname:
        raise refuse("names no host")
    if parts.username is not None or parts.password is not None:
        raise refuse("is refused: credentials in the URL are not allowed (the events are signed)")
    host, bracketed = parts.hostname.rstrip("."), "[" in parts.netloc
    if not bracketed and ":" not in host:
        try:
            # As a resolver would see it: IDNA maps e.g. full-width digits to ASCII ones.
            host = host.encode("idna").decode("ascii").lower()
        except UnicodeError:
            raise refuse(f"is refused: {host!r} is not a valid host name") from None
    try:
        literal = _literal(host, bracketed)
    except ValueError:
        raise refuse(f"is refused: {host!r} is not a valid address") from None
    names, networks = _allowed(settings.webhook_allowed_hosts)
    if literal is not None:
        addresses = [str(literal)]
    else:
        if not _NAME.fullmatch(host):
            raise refuse(f"is refused: {host!r} is not a valid host name")
        if resolve is None:
            return []
        try:
            addresses = resolve(host, port)
        except OSError as exc:
            if unresolved_ok:
                return []
            raise refuse(f"is refused: host {host!r} does not resolve ({exc})") from None
        if not addresses:
            raise refuse(f"is refused: host {host!r} resolves to no address")
        if host in names:
            return addresses  # the admin allowed this name, whatever it resolves to
    for address in addresses:
        ip = ipaddress.ip_address(address)
        if any(ip.version == n.version and ip in n for n in networks):
            continue
        if (reason := refusal(ip)) is not None:
            via = "" if literal is not None else f" ({host!r} resolves to {ip})"
            raise refuse(f"is refused: {ip} is {reason}{via}; an admin may allow it in LLM_BATCH_WEBHOOK_ALLOWED_HOSTS")
        if not settings.webhook_allow_public:
            raise refuse(f"is refused: {host!r} is not in LLM_BATCH_WEBHOOK_ALLOWED_HOSTS "
                         "(LLM_BATCH_WEBHOOK_ALLOW_PUBLIC is off)")
    return addresses
