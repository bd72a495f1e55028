"""Keyset pages of a table's rows (the store's listings) and the checks of their arguments."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Column, ColumnElement, Connection, Row, Table, and_, func, or_, select

from llm_batch.infra.jobstore.errors import InvalidCursor

MAX_PAGE_SIZE = 1000


def check_page(limit: int, offset: int) -> None:
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise ValueError(f"limit must be between 1 and {MAX_PAGE_SIZE}, got {limit}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")


def ordering(table: Table, order_by: str, allowed: set[str]) -> tuple[Column[Any], bool]:
    """The column and direction (descending?) named by ``[-]column``."""
    descending = order_by.startswith("-")
    name = order_by.lstrip("-+")
    if name not in allowed:
        raise ValueError(f"cannot order by {order_by!r}; use one of {sorted(allowed)} (prefix - for descending)")
    return table.c[name], descending


def page(
    connection: Connection,
    table: Table,
    filters: list[ColumnElement[bool]],
    order: tuple[Column[Any], bool],
    limit: int,
    offset: int,
    after: str | None,
    *,
    owner: str | None,
) -> tuple[list[Row], int]:
    """One page of rows in (column, id) order and the count of all rows matching `filters`;
    ``after``: the rows strictly after that row. It must be `owner`'s (when given): another
    owner's id is as unknown as a made-up one, so a listing tells nothing of others' rows."""
    column, descending = order
    total = connection.scalar(select(func.count()).select_from(table).where(*filters)) or 0
    query = select(table).where(*filters)
    if after is not None:
        cursor = connection.execute(select(column, table.c.id).where(*owned(table, after, owner))).one_or_none()
        if cursor is None:
            raise InvalidCursor(f"after={after!r} names no {table.name.removesuffix('s')} of this listing")
        value, cursor_id = cursor
        if descending:
            query = query.where(or_(column < value, and_(column == value, table.c.id < cursor_id)))
        else:
            query = query.where(or_(column > value, and_(column == value, table.c.id > cursor_id)))
    ordering = (column.desc(), table.c.id.desc()) if descending else (column.asc(), table.c.id.asc())
    rows = connection.execute(query.order_by(*ordering).limit(limit).offset(offset)).all()
    return list(rows), total


def given(**values: Any) -> dict[str, Any]:
    """The arguments that were given (None: not given)."""
    return {name: value for name, value in values.items() if value is not None}


def matching(table: Table, **values: Any) -> list[ColumnElement[bool]]:
    """WHERE clauses: each given (not None) column equals its value."""
    return [table.c[name] == value for name, value in given(**values).items()]


def owned(table: Table, row_id: str, owner: str | None) -> list[ColumnElement[bool]]:
    """WHERE clauses: this id, and this owner's if one is given."""
    return matching(table, id=row_id, owner=owner)
