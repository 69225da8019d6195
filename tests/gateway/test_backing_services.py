"""The real redis-server and Postgres fixtures (tests/services.py) start and answer."""


def test_redis(redis_url):
    import redis

    r = redis.Redis.from_url(redis_url)
    assert r.ping()


def test_pg(postgres_url):
    import sqlalchemy as sa

    e = sa.create_engine(postgres_url)
    with e.connect() as c:
        assert c.execute(sa.text("select 1")).scalar() == 1
