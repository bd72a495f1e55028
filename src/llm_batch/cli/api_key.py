"""``llm-batch api-key create|list|revoke``: API keys for the batch REST API; a key is shown once,
at creation (the store keeps only its hash)."""

from __future__ import annotations

import argparse
import sys

from llm_batch.cli import fail, print_table
from llm_batch.core.owners import OwnerNameRefused


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("api-key", help="create, list and revoke API keys of the batch REST API")
    parser.add_argument("--database-url", help="the job store (default: LLM_BATCH_DATABASE_URL, else the embedded stack's)")
    actions = parser.add_subparsers(dest="api_key_command", required=True)

    create = actions.add_parser("create", help="create a key for OWNER and print it (shown only once)")
    create.add_argument("owner", help="the user the key acts for (owner of the jobs and files it creates): "
                        "lower-case letters, digits, '-', '_', '.' or '@', as Airflow spells the same user")
    create.add_argument("--name", default="", help="a label to recognise the key by")
    create.add_argument("--admin", action="store_true", help="the key sees and manages every user's jobs")
    create.set_defaults(func=_answering(create_key))

    listing = actions.add_parser("list", help="list keys (never their secrets)")
    listing.add_argument("--owner", help="only this user's keys")
    listing.add_argument("--all", action="store_true", help="include revoked keys")
    listing.set_defaults(func=_answering(list_keys))

    revoke = actions.add_parser("revoke", help="revoke a key by its id (key_...)")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=_answering(revoke_key))


def _answering(action):
    """`action`, with a job store that does not answer said in one line (exit 1)."""
    def run(args: argparse.Namespace) -> int:
        from sqlalchemy.exc import OperationalError  # heavy

        try:
            return action(args)
        except OperationalError as exc:
            return fail(f"the job store does not answer: {str(exc.orig).strip().splitlines()[0]}; "
                        "is the stack up? (llm-batch status)", 1)
    return run


def _store(args: argparse.Namespace):
    from llm_batch.devstack.home import job_store_url  # heavy
    from llm_batch.infra.jobstore import get_job_store  # heavy

    return get_job_store(job_store_url(args.database_url, settings=args.settings))


def create_key(args: argparse.Namespace) -> int:
    try:
        record, plaintext = _store(args).create_api_key(args.owner, args.name or args.owner, is_admin=args.admin)
    except OwnerNameRefused as exc:
        return fail(str(exc), 1)
    print(f"id: {record.id}\nowner: {record.owner}\nadmin: {record.is_admin}", file=sys.stderr)
    print("the key (shown only now; store it safely):", file=sys.stderr)
    print(plaintext)
    return 0


def list_keys(args: argparse.Namespace) -> int:
    keys = _store(args).list_api_keys(owner=args.owner, include_revoked=args.all)
    rows = [("ID", "OWNER", "NAME", "ADMIN", "CREATED", "REVOKED")]
    for key in keys:
        revoked = key.revoked_at.isoformat(timespec="seconds") if key.revoked_at else "-"
        rows.append((key.id, key.owner, key.name, "yes" if key.is_admin else "no",
                     key.created_at.isoformat(timespec="seconds"), revoked))
    print_table(rows)
    return 0


def revoke_key(args: argparse.Namespace) -> int:
    from llm_batch.infra.jobstore import ApiKeyNotFound  # heavy

    try:
        key = _store(args).revoke_api_key(args.key_id)
    except ApiKeyNotFound as exc:
        return fail(str(exc), 1)
    print(f"revoked {key.id} (owner {key.owner})")
    return 0
