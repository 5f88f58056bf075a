"""`weightship status` shows who seeded whom and the failing golden prompt."""

from __future__ import annotations

from rich.console import Console

from weightship.statusview import render


def test_status_shows_pod_loads_and_the_failing_prompt() -> None:
    rollout = {
        "metadata": {"name": "llm", "namespace": "serving"},
        "spec": {"replicas": 3, "strategy": {"canary": {"steps": [{"setWeight": 100}]}}},
        "status": {
            "phase": "Degraded",
            "verification": {
                "podTemplateHash": "abc",
                "loads": [
                    {"pod": "llm-abc-1", "source": "cache", "seconds": 0.5},
                    {
                        "pod": "llm-abc-2",
                        "source": "broadcast",
                        "seededFrom": "llm-abc-1",
                        "seconds": 1.25,
                    },
                ],
                "failures": [
                    {
                        "pod": "llm-abc-3",
                        "reason": "GoldenPromptFailed",
                        "prompt": "capital-france",
                        "expected": 'equals " Paris."',
                        "got": " Lyon.",
                    }
                ],
            },
        },
    }
    console = Console(width=200, record=True)
    console.print(render(rollout))
    text = console.export_text()
    assert "llm-abc-2" in text and "broadcast" in text and "1.25" in text
    assert "llm-abc-1" in text  # the seeding root, named on its receiver's row
    assert "capital-france" in text and "Lyon." in text and "Paris." in text


def test_status_says_which_mode_verified_each_pod() -> None:
    rollout = {
        "metadata": {"name": "llm", "namespace": "serving"},
        "spec": {"replicas": 2, "strategy": {"canary": {"steps": [{"setWeight": 100}]}}},
        "status": {
            "phase": "Healthy",
            "verification": {
                "podTemplateHash": "abc",
                "loads": [
                    {"pod": "vllm-abc-1", "source": "cache", "mode": "loaded"},
                    {"pod": "plain-abc-2", "mode": "staged"},
                ],
            },
        },
    }
    console = Console(width=200, record=True)
    console.print(render(rollout))
    lines = console.export_text().splitlines()
    assert "server's load report" in next(line for line in lines if "vllm-abc-1" in line)
    assert "verified node cache" in next(line for line in lines if "plain-abc-2" in line)


def test_status_says_what_became_of_the_adopted_deployment() -> None:
    def shown(status: dict[str, object]) -> str:
        rollout = {
            "metadata": {"name": "llm", "namespace": "serving"},
            "spec": {"replicas": 2, "workloadRef": {"name": "llm-old"}},
            "status": status,
        }
        console = Console(width=200, record=True)
        console.print(render(rollout))
        return next(line for line in console.export_text().splitlines() if "Workload" in line)

    assert "llm-old keeps its replicas" in shown({"phase": "Prefetching"})
    handed_over = shown({"phase": "Healthy", "workload": {"name": "llm-old", "replicas": 3}})
    assert "llm-old scaled to 0" in handed_over and "gets 3 replicas back" in handed_over


def test_status_shows_each_pods_revision_and_last_swap_of_an_in_place_rollout() -> None:
    rollout = {
        "metadata": {"name": "llm", "namespace": "serving"},
        "spec": {"replicas": 2, "strategy": {"canary": {"steps": [{"setWeight": 50}]}}},
        "status": {
            "phase": "Progressing",
            "canaryRevision": {
                "revision": "v2",
                "podTemplateHash": "h2",
                "update": "InPlace",
                "updateReason": "only spec.model changed: running pods swap their weights",
            },
            "inPlace": {
                "swapping": "llm-t-a",
                "swappingPods": 1,
                "maxUnavailable": 2,
                "pods": [
                    {"pod": "llm-t-a", "revision": "v1", "arrival": "Started"},
                    {
                        "pod": "llm-t-b",
                        "revision": "v2",
                        "arrival": "Swapped",
                        "swapState": "Swapped",
                        "swapTo": "v2",
                        "swapSeconds": 1.75,
                        "pausedSeconds": 0.42,
                    },
                    {
                        "pod": "llm-t-c",
                        "revision": "v2",
                        "arrival": "Swapped",
                        "swapState": "Swapped",
                        "swapTo": "v2",
                        "swapSeconds": 0.31,
                        "pausedSeconds": 0.2,
                        "inTraffic": True,
                        "heldSeconds": 2.68,
                    },
                ],
            },
        },
    }
    console = Console(width=200, record=True)
    console.print(render(rollout))
    text = console.export_text()
    assert "InPlace: only spec.model changed" in text
    assert "Pods (1 swapping, at most 2 out of traffic at once)" in text
    row = next(line for line in text.splitlines() if "llm-t-b" in line)
    assert "v2" in row and "Swapped to v2" in row and "1.75" in row and "0.42" in row
    assert "Started" in next(line for line in text.splitlines() if "llm-t-a" in line)
    held = next(line for line in text.splitlines() if "llm-t-c" in line)
    assert "Swapped to v2 in traffic" in held and "2.68" in held, held
