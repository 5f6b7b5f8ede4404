"""Runs one nsbox.run from a JSON request on stdin and prints the Result as JSON.

Used by the tests to launch sandboxes as an unprivileged uid (see conftest.run_as).
"""

import base64
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nsbox  # noqa: E402
from nsbox.policy.policy import Bind, Seccomp, SeccompArg, SeccompRule  # noqa: E402


def invoke(argv: list, kwargs: dict) -> nsbox.Result:
    """nsbox.run with the test's simple keyword arguments turned into a Policy."""
    kwargs = dict(kwargs)
    if "stdin_b64" in kwargs:
        kwargs["stdin"] = base64.b64decode(kwargs.pop("stdin_b64"))
    policy = nsbox.Policy()
    if "profile" in kwargs:  # a shipped profile or a file, with overrides (nsbox/profiles/)
        from nsbox.profiles import load_profile

        policy = load_profile(kwargs.pop("profile"), kwargs.pop("overrides", None))
    changes = dict(kwargs.pop("policy_changes", {}))
    if isinstance(changes.get("network"), dict):  # JSON carries the network policy as a dict
        net = dict(changes["network"], allow=tuple(changes["network"].get("allow", ())))
        changes["network"] = nsbox.Network(**net)
    binds = kwargs.pop("binds", [])
    if binds:
        changes["mounts"] = policy.mounts + tuple(Bind(*b) for b in binds)
    extra_mounts = kwargs.pop("mounts", [])  # mounts of any kind, as {"kind": ..., fields}
    if extra_mounts:
        from nsbox.policy.policy import MOUNT_KINDS

        changes["mounts"] = changes.get("mounts", policy.mounts) + tuple(
            MOUNT_KINDS[m["kind"]](**{k: v for k, v in m.items() if k != "kind"})
            for m in extra_mounts)
    if "seccomp" in kwargs:  # dataclasses.asdict of a Seccomp
        spec = kwargs.pop("seccomp")
        rules = tuple(SeccompRule(r["syscall"], r["action"],
                                  tuple(SeccompArg(**a) for a in r["args"]))
                      for r in spec.pop("rules"))
        changes["seccomp"] = Seccomp(rules=rules, **spec)
    limit_changes = kwargs.pop("limit_changes", {})
    policy = policy.replace(**changes).with_limits(**limit_changes)
    wire_changes = kwargs.pop("wire_changes", None)
    if wire_changes is not None:
        return run_changed_plan(argv, policy, json.loads(json.dumps(wire_changes)), kwargs)
    return nsbox.run(argv, policy, **kwargs)


def run_changed_plan(argv: list, policy: nsbox.Policy, wire_changes: dict,
                     kwargs: dict) -> nsbox.Result:
    """nsbox.run with the plan changed after it was built, as the helper receives it: a
    failure the policy's checks would not let through (a source gone since the plan was made,
    say), to see each launch core report it. ``wire_changes``: top-level keys of the plan,
    and "mounts" as {target: {key: value}} for the plan's operations on that target."""
    from nsbox.host.network import RunNetwork
    from nsbox.launch import launcher

    plan = launcher.build_plan(policy, argv, env=kwargs.get("env"), cwd=kwargs.get("cwd"),
                               wall_time=kwargs.get("timeout"))
    wire = plan.to_wire()
    wire.update(host_uid=policy.host_uid, host_gid=policy.host_gid)
    for target, op_changes in wire_changes.pop("mounts", {}).items():
        for op in wire["mounts"]:
            if op["target"] == target:
                op.update(op_changes)
    wire.update(wire_changes)
    return launcher.launch_wire(wire, None, policy.limits.output, False, RunNetwork(policy.network))


def main() -> None:
    request = json.load(sys.stdin)
    try:
        result = invoke(request["argv"], request["kwargs"])
    except nsbox.NsboxError as exc:
        out = {"error_type": type(exc).__name__, "message": getattr(exc, "message", str(exc)),
               "step": getattr(exc, "step", None), "errno": getattr(exc, "errno", None),
               "hint": exc.hint, "feature": getattr(exc, "feature", None),
               "key": getattr(exc, "key", None), "rule": getattr(exc, "rule", None)}
        print(json.dumps(out))
        return
    data = result.to_dict()
    data["status"] = result.status.value
    data["stdout_b64"] = base64.b64encode(result.stdout).decode()
    data["stderr_b64"] = base64.b64encode(result.stderr).decode()
    print(json.dumps(data))


if __name__ == "__main__":
    main()
