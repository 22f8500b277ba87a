#!/bin/bash
# Prepares one Docker Swarm node to hold cellblock sessions, or (--check) verifies it.
#
# Run as root on every node that will run sessions, after its dockerd is up and
# again after each reboot or dockerd restart (the firewall rules are not
# persistent). Idempotent: what is already there is left as it is.
#
#  1. A config-only bridge network, the local half of the swarm network
#     `cellblock-sessions` (created once on a manager with --config-from): the
#     sessions' bridge gets a fixed name so the rules below can name it, no
#     inter-container traffic and no masquerading.
#  2. Firewall rules in this node's network namespace: a session can open no
#     connection to the node itself (INPUT) nor through it (DOCKER-USER, or
#     FORWARD where Docker made no DOCKER-USER), for IPv4 and IPv6. Replies to
#     connections made *to* a session's published port still pass.
#  3. With --allow-from: new connections to the sessions (their published ports)
#     only from those sources, the hosts of cellblock's front.
#  4. Inbound connections enter a session from the node's own address on its
#     bridge (masquerade into the bridge), since a session has no default route.
#  5. With --ksm: the kernel's same-page merging running, for the kernels of
#     `serve --swarm-share-boot-memory` (docs/scale-out.md, "Density"); their
#     fixed address layout also needs the node's dockerd started with
#     `--seccomp-profile` holding `cellblock seccomp-profile` (README.md).
set -euo pipefail

DOCKER=${DOCKER:-docker}
HOST=""
CHECK=0
CONFIG_NETWORK=cellblock-sessions-config
BRIDGE=cbsess0
SUBNET=10.215.0.0/24
ALLOW_FROM=""
KSM=0
KSM_PAGES_TO_SCAN=${KSM_PAGES_TO_SCAN:-1000}
INBOUND_CHAIN=CELLBLOCK-SESSIONS-IN

usage() {
    cat <<EOF
usage: $0 [-H DOCKER_HOST] [--subnet CIDR] [--bridge NAME] [--allow-from CIDR,...] [--check]

  -H, --host HOST   docker daemon to configure (default: the docker CLI's own)
  --subnet CIDR     sessions' subnet on this node (default $SUBNET)
  --bridge NAME     sessions' bridge device (default $BRIDGE)
  --allow-from LIST IPv4 sources (comma-separated CIDRs) that may open connections
                    to sessions; default: any (then firewall the node's ports yourself)
  --ksm             run the kernel's same-page merging (ksmd), for
                    serve --swarm-share-boot-memory; scans \$KSM_PAGES_TO_SCAN
                    pages (default $KSM_PAGES_TO_SCAN) every 20 ms
  --check           change nothing; exit 1 unless everything is in place
The docker CLI used is \$DOCKER (default: docker on PATH).
EOF
}

while [ $# -gt 0 ]; do
    case "$1" in
        -H|--host) HOST=$2; shift 2 ;;
        --subnet) SUBNET=$2; shift 2 ;;
        --bridge) BRIDGE=$2; shift 2 ;;
        --allow-from) ALLOW_FROM=$2; shift 2 ;;
        --check) CHECK=1; shift ;;
        --ksm) KSM=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "node-setup: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
done

dock() {
    if [ -n "$HOST" ]; then "$DOCKER" -H "$HOST" "$@"; else "$DOCKER" "$@"; fi
}

missing=0
report() { # STATE WHAT
    printf 'node-setup: %-8s %s\n' "$1" "$2"
    if [ "$1" = missing ] || [ "$1" = wrong ]; then missing=1; fi
}

# --- 1. the config-only network -------------------------------------------
want="$SUBNET $BRIDGE false false"
if have=$(dock network inspect "$CONFIG_NETWORK" --format \
        '{{range .IPAM.Config}}{{.Subnet}}{{end}} {{index .Options "com.docker.network.bridge.name"}} {{index .Options "com.docker.network.bridge.enable_icc"}} {{index .Options "com.docker.network.bridge.enable_ip_masquerade"}}' 2>/dev/null); then
    if [ "$have" = "$want" ]; then
        report present "network $CONFIG_NETWORK ($want)"
    else
        # Replacing it would need the swarm network that uses it removed first.
        report wrong "network $CONFIG_NETWORK is '$have', want '$want': remove it and rerun"
    fi
elif [ "$CHECK" = 1 ]; then
    report missing "network $CONFIG_NETWORK"
else
    dock network create --config-only --subnet "$SUBNET" \
        -o com.docker.network.bridge.name="$BRIDGE" \
        -o com.docker.network.bridge.enable_icc=false \
        -o com.docker.network.bridge.enable_ip_masquerade=false \
        "$CONFIG_NETWORK" >/dev/null
    report created "network $CONFIG_NETWORK ($want)"
fi

# --- 2. the firewall --------------------------------------------------------
# NEW (and INVALID, UNTRACKED) packets from the sessions' bridge are dropped;
# ESTABLISHED/RELATED pass, which are the replies to inbound connections,
# whether those came through docker-proxy or through Docker's DNAT (FORWARD).
rule=(-i "$BRIDGE" -m conntrack ! --ctstate ESTABLISHED,RELATED -j DROP)

ensure_rule() { # TOOL CHAIN
    local tool=$1 chain=$2
    if "$tool" -w -C "$chain" "${rule[@]}" 2>/dev/null; then
        report present "$tool $chain ${rule[*]}"
    elif [ "$CHECK" = 1 ]; then
        report missing "$tool $chain ${rule[*]}"
    else
        "$tool" -w -I "$chain" "${rule[@]}"
        report added "$tool $chain ${rule[*]}"
    fi
}

forward_chain() { # TOOL: Docker's DOCKER-USER runs before its own FORWARD rules
    if "$1" -w -n -L DOCKER-USER >/dev/null 2>&1; then echo DOCKER-USER; else echo FORWARD; fi
}

ensure_rule iptables INPUT
ensure_rule iptables "$(forward_chain iptables)"
if command -v ip6tables >/dev/null && ip6tables -w -n -L INPUT >/dev/null 2>&1; then
    ensure_rule ip6tables INPUT
    ensure_rule ip6tables "$(forward_chain ip6tables)"
else
    report skipped "ip6tables (not available here)"
fi

# --- 3. who may connect to the sessions -----------------------------------------
# A chain of our own, rebuilt on every run, so that changing the list needs no cleanup.
if [ -n "$ALLOW_FROM" ]; then
    want_chain=$(printf -- '-N %s\n' "$INBOUND_CHAIN"
                 IFS=, ; for cidr in $ALLOW_FROM; do printf -- '-A %s -s %s -j RETURN\n' "$INBOUND_CHAIN" "$cidr"; done
                 printf -- '-A %s -j DROP\n' "$INBOUND_CHAIN")
    # iptables -S prints a /32 as such, so the wanted list is normalized the same way.
    want_chain=$(echo "$want_chain" | sed -E 's#-s ([0-9.]+) #-s \1/32 #')
    have_chain=$(iptables -w -S "$INBOUND_CHAIN" 2>/dev/null || true)
    if [ "$have_chain" = "$want_chain" ]; then
        report present "iptables chain $INBOUND_CHAIN (allow $ALLOW_FROM)"
    elif [ "$CHECK" = 1 ]; then
        report missing "iptables chain $INBOUND_CHAIN (allow $ALLOW_FROM)"
    else
        iptables -w -N "$INBOUND_CHAIN" 2>/dev/null || iptables -w -F "$INBOUND_CHAIN"
        IFS=, read -ra cidrs <<<"$ALLOW_FROM"
        for cidr in "${cidrs[@]}"; do iptables -w -A "$INBOUND_CHAIN" -s "$cidr" -j RETURN; done
        iptables -w -A "$INBOUND_CHAIN" -j DROP
        report set "iptables chain $INBOUND_CHAIN (allow $ALLOW_FROM)"
    fi
    rule=(-o "$BRIDGE" -m conntrack --ctstate NEW -j "$INBOUND_CHAIN")
    ensure_rule iptables "$(forward_chain iptables)"
fi

# --- 4. inbound from the node's own address -----------------------------------
# cellblock's shim deletes a session's default route (no packet can leave it for
# anywhere but its own subnet), so a connection to a published port must reach
# the session from an address on that subnet: the node's end of the bridge.
# Masquerading what goes *into* the bridge does that; the sources were already
# judged in DOCKER-USER above (filtering runs before POSTROUTING).
nat_rule=(-o "$BRIDGE" -m addrtype ! --src-type LOCAL -j MASQUERADE)
if iptables -w -t nat -C POSTROUTING "${nat_rule[@]}" 2>/dev/null; then
    report present "iptables nat POSTROUTING ${nat_rule[*]}"
elif [ "$CHECK" = 1 ]; then
    report missing "iptables nat POSTROUTING ${nat_rule[*]}"
else
    iptables -w -t nat -I POSTROUTING "${nat_rule[@]}"
    report added "iptables nat POSTROUTING ${nat_rule[*]}"
fi

# --- 5. same-page merging -----------------------------------------------------
# Only memory a process marks (MADV_MERGEABLE) is ever merged: turning ksmd on
# changes nothing for the node's other processes but the CPU it scans with.
if [ "$KSM" = 1 ]; then
    ksm=/sys/kernel/mm/ksm
    if [ ! -w "$ksm/run" ] && [ "$CHECK" = 0 ]; then
        report missing "$ksm/run (this kernel has no KSM, or /sys is read-only here)"
    elif [ "$(cat "$ksm/run" 2>/dev/null)" = 1 ]; then
        report present "ksmd running ($ksm/run = 1)"
    elif [ "$CHECK" = 1 ]; then
        report missing "ksmd running ($ksm/run = 1)"
    else
        echo "$KSM_PAGES_TO_SCAN" > "$ksm/pages_to_scan"
        echo 20 > "$ksm/sleep_millisecs"
        echo 1 > "$ksm/run"
        report set "ksmd running ($ksm/run = 1, pages_to_scan $KSM_PAGES_TO_SCAN)"
    fi
fi

if [ "$CHECK" = 1 ] && [ "$missing" = 1 ]; then
    echo "node-setup: this node is NOT ready for cellblock sessions" >&2
    exit 1
fi
if [ "$missing" = 1 ]; then exit 1; fi
echo "node-setup: ready"
