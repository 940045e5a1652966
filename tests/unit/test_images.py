"""Image references: the distribution grammar, Docker's normalisation, and messages that say what is wrong."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from podium.images import ImageRef, parse_image

DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize(
    "text,registry,repository,tag,digest",
    [
        ("ubuntu", "docker.io", "library/ubuntu", "latest", None),
        ("ubuntu:22.04", "docker.io", "library/ubuntu", "22.04", None),
        ("team/app", "docker.io", "team/app", "latest", None),
        ("docker.io/ubuntu", "docker.io", "library/ubuntu", "latest", None),
        ("index.docker.io/team/app:1", "docker.io", "team/app", "1", None),
        ("localhost:5000/a/b:1.4", "localhost:5000", "a/b", "1.4", None),
        ("localhost/app", "localhost", "app", "latest", None),
        ("Registry.Example.COM:8443/team/app", "registry.example.com:8443", "team/app", "latest", None),
        ("127.0.0.1:5000/x", "127.0.0.1:5000", "x", "latest", None),
        ("[::1]:5000/x/y:v_1", "[::1]:5000", "x/y", "v_1", None),
        ("ghcr.io/o/a.b__c-d---e/f:_x.Y-9", "ghcr.io", "o/a.b__c-d---e/f", "_x.Y-9", None),
        (f"app@{DIGEST}", "docker.io", "library/app", None, DIGEST),
        (f"reg.io/app:1.4@{DIGEST}", "reg.io", "app", "1.4", DIGEST),
        # no "/" after it: "localhost:5000" is the image "localhost" with the tag "5000", as in Docker
        ("localhost:5000", "docker.io", "library/localhost", "5000", None),
    ],
)
def test_references_parse_and_normalise(text: str, registry: str, repository: str, tag: str | None, digest: str | None) -> None:
    assert parse_image(text) == ImageRef(registry, repository, tag, digest)


@pytest.mark.parametrize(
    "text,words",
    [
        ("", "the reference is empty"),
        ("team/app 1", "no spaces"),
        ("UPPER/x", "the repository 'UPPER/x' must be lowercase"),
        ("reg.io/Team/app", "the repository 'Team/app' must be lowercase"),
        ("a@sha256:short", "the digest 'sha256:short' is not 'sha256:' followed by 64 lowercase hex digits"),
        (f"a@{DIGEST.upper()}", "is not 'sha256:'"),
        (f"a@{DIGEST}@{DIGEST}", "at most one '@'"),
        ("app:", "the tag after ':' is empty"),
        ("app:v1!", "the tag 'v1!' has a character not allowed in a tag (A-Z a-z 0-9 _ . -)"),
        ("app:.hidden", "the tag '.hidden' must begin with a letter, a digit or '_'"),
        ("app:" + "t" * 129, "longer than 128 characters"),
        (":1.4", "the repository name is missing"),
        ("a//b", "an empty part"),
        ("team/", "an empty part"),
        ("team/app-", "the repository part 'app-' is not allowed"),
        ("team/_app", "the repository part '_app' is not allowed"),
        ("team/a...b", "the repository part 'a...b' is not allowed"),
        ("reg.io:0/app", "the registry port '0' is not a number from 1 to 65535"),
        ("reg.io:99999/app", "the registry port '99999'"),
        ("-reg.io/app", "the registry host '-reg.io' is not a host name"),
        ("reg..io/app", "the registry host 'reg..io'"),
        ("[::1/app", "[IPv6]"),
        ("a" * 64, "64 hex digits are an image ID"),
        ("reg.io/" + "a" * 250, "longer than 255 characters"),
    ],
)
def test_bad_references_say_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_image(text)
    message = str(e.value)
    assert message.startswith(f"image {text!r}: ")
    assert words in message


def test_pinned_names_the_digest_and_drops_the_tag() -> None:
    ref = parse_image("localhost:5000/a/b:1.4")
    assert ref.pinned(DIGEST) == f"localhost:5000/a/b@{DIGEST}"
    assert parse_image(ref.pinned(DIGEST)) == ImageRef("localhost:5000", "a/b", None, DIGEST)
    assert parse_image("ubuntu").pinned(DIGEST) == f"docker.io/library/ubuntu@{DIGEST}"
    with pytest.raises(ValueError, match="is not 'sha256:'"):
        ref.pinned("sha256:short")


def test_the_registry_is_asked_for_the_digest_when_there_is_one() -> None:
    assert parse_image("app:1.4").reference == "1.4"
    assert parse_image(f"app:1.4@{DIGEST}").reference == DIGEST


# --- properties -----------------------------------------------------------------------------------------

components = st.from_regex(r"[a-z0-9]{1,6}(?:(?:[._]|__|-{1,3})[a-z0-9]{1,6}){0,2}", fullmatch=True)
paths = st.lists(components, min_size=2, max_size=4).map("/".join)
labels = st.from_regex(r"[a-z0-9](?:[a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)
hosts = st.one_of(
    st.just("localhost"),
    st.lists(labels, min_size=2, max_size=3).map(".".join).filter(lambda h: "docker.io" not in h),
)
ports = st.one_of(st.none(), st.integers(1, 65535))
tags = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True)
digests = st.binary(min_size=32, max_size=32).map(lambda b: "sha256:" + b.hex())


@given(host=hosts, port=ports, path=paths, tag=st.one_of(st.none(), tags), digest=st.one_of(st.none(), digests))
def test_any_reference_of_the_grammar_parses_to_its_parts(
    host: str, port: int | None, path: str, tag: str | None, digest: str | None
) -> None:
    registry = host if port is None else f"{host}:{port}"
    text = f"{registry}/{path}" + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
    ref = parse_image(text)
    assert ref == ImageRef(registry, path, tag or (None if digest else "latest"), digest)
    assert parse_image(str(ref)) == ref  # the printed form is a reference to the same image


@given(st.text(max_size=80))
def test_any_text_parses_or_gets_a_message_naming_it(text: str) -> None:
    try:
        ref = parse_image(text)
    except ValueError as e:
        assert str(e).startswith(f"image {text!r}: ")
    else:
        assert parse_image(str(ref)) == ref


@given(path=paths, good=tags, bad=st.sampled_from("!$%&*()+=,;?~^'\"<>|\\é"))
def test_a_tag_with_a_forbidden_character_is_named(path: str, good: str, bad: str) -> None:
    tag = good + bad
    with pytest.raises(ValueError) as e:
        parse_image(f"reg.io/{path}:{tag}")
    assert f"the tag {tag!r} has a character not allowed in a tag" in str(e.value)
