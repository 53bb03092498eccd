"""The PostgreSQL backend of buffer.Buffer (`--buffer postgresql://user@host:port/db`), and
`open_buffer`, which opens either kind of buffer."""

import re
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import buffer


class Postgres:
    """The PostgreSQL dialect (psycopg 3), advisory locks for readers and explorer names; ValueError
    (one line)."""

    def __init__(
        self, url: str, timeout_s: float, schema_sql: str, run_dir: str | Path | None = None
    ):
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        run = (
            ""
            if run_dir is None
            else "_" + re.sub(r"[^a-z0-9_]", "_", Path(run_dir).resolve().name.lower())[:54]
        )
        schema = query.pop("schema", f"nanorft{run}")
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", schema):
            raise ValueError(
                f"buffer schema {schema!r}: use lower-case letters, digits and _ (at most 63)"
            )
        self.schema, self.where = (
            schema,
            urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1], query="")),
        )
        self.where += f" (schema {schema})"  # no password in messages
        try:
            import psycopg
        except ImportError:
            raise ValueError(
                f'buffer {self.where}: PostgreSQL needs psycopg: pip install "psycopg[binary]"'
            ) from None
        dsn = urlunsplit(parts._replace(query=urlencode(query)))
        try:
            self.conn = psycopg.connect(
                dsn, autocommit=True, connect_timeout=max(1, int(min(timeout_s, 60)))
            )
            self.conn.execute(f"SET search_path TO {schema}")
            # creating the tables: one process at a time (concurrent CREATE ... IF NOT EXISTS can
            # collide), and only when missing (CREATE INDEX waits for every open transaction on the
            # table)
            with self.conn.transaction():
                self.conn.execute("SELECT pg_advisory_xact_lock(hashtext('nanorft schema'))")
                # the newest table
                if self.conn.execute("SELECT to_regclass('replays')").fetchone()[0] is None:
                    self.conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
                    self.conn.execute(schema_sql.format(id="BIGSERIAL PRIMARY KEY", blob="BYTEA"))
        except psycopg.Error as e:
            raise ValueError(f"buffer {self.where}: {' '.join(str(e).split())}") from None

    @contextmanager
    def _lost(self):
        """A broken connection: ConnectionError, one line (nothing is retried: --resume
        continues)."""
        import psycopg

        try:
            yield
        except psycopg.OperationalError as e:
            if not self.conn.broken and not self.conn.closed:
                raise
            raise ConnectionError(
                f"buffer {self.where}: connection to the server lost ({' '.join(str(e).split())}); "
                "when it is back, the same commands with --resume continue the run"
            ) from None

    def execute(self, sql: str, params=()):
        with self._lost():
            return self.conn.execute(sql.replace("?", "%s"), params)

    def executemany(self, sql: str, rows) -> None:
        with self._lost():
            self.conn.cursor().executemany(sql.replace("?", "%s"), list(rows))

    @contextmanager
    def transaction(self, readers: bool = False):
        """One transaction; `readers`: serialised with the run's other readers."""
        with self._lost(), self.conn.transaction():
            if readers:
                self.execute(
                    "SELECT pg_advisory_xact_lock(hashtext(?))", (f"{self.schema} readers",)
                )
            yield

    def name_lock(self, name: str) -> tuple[str]:
        return (f"{self.schema} explorer {name}",)

    def hold(self, name: str, wait: bool) -> bool:
        key = self.name_lock(name)
        if self.execute("SELECT pg_try_advisory_lock(hashtext(?))", key).fetchone()[0]:
            return True
        if wait:
            self.execute("SELECT pg_advisory_lock(hashtext(?))", key)
        return wait

    def held(self, name: str) -> bool:
        key = self.name_lock(name)
        if self.execute("SELECT pg_try_advisory_lock(hashtext(?))", key).fetchone()[0]:
            self.execute("SELECT pg_advisory_unlock(hashtext(?))", key)
            return False
        return True

    def close(self) -> None:
        self.conn.close()


def open_buffer(url: str, run_dir: str | Path | None = None, timeout_s: float = 60.0):
    """buffer.open_buffer for a SQLite path or a postgresql:// URL; ValueError (one line)."""
    backend = Postgres if str(url).startswith(buffer.POSTGRES) else None
    return buffer.open_buffer(url, run_dir, timeout_s, backend)
