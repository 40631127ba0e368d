# Hosts made of network namespaces on this machine, for the recipes beside this file (sourced;
# needs root). No traffic leaves them: a bridge in a namespace of its own, one veth pair per
# host. make_hosts TAG NET NAME...: host NAME gets namespace TAG+NAME, address NET.<1, 2, ...>
# on eth0, and its port "portNAME" on the bridge in TAG+br (detach it to cut the host off).

make_hosts() {
  hosts_tag=$1 hosts_net=$2
  shift 2
  hosts_names=("$@")
  ip netns add "${hosts_tag}br"
  ip -n "${hosts_tag}br" link add br0 type bridge
  ip -n "${hosts_tag}br" link set br0 up
  local i=0 h
  for h in "${hosts_names[@]}"; do
    i=$((i + 1))
    ip netns add "$hosts_tag$h"
    ip -n "$hosts_tag$h" link set lo up
    ip -n "${hosts_tag}br" link add "port$h" type veth peer name eth0 netns "$hosts_tag$h"
    ip -n "${hosts_tag}br" link set "port$h" master br0 up
    ip -n "$hosts_tag$h" addr add "$hosts_net.$i/24" dev eth0
    ip -n "$hosts_tag$h" link set eth0 up
  done
}

remove_hosts() {  # every process in the hosts (a machine losing power), then the hosts and the bridge
  local h
  for h in "${hosts_names[@]}"; do ip netns pids "$hosts_tag$h" 2>/dev/null | xargs -r kill -9 2>/dev/null || true; done
  for h in "${hosts_names[@]}" br; do ip netns delete "$hosts_tag$h" 2>/dev/null || true; done
}

wait_for() {  # wait_for WHAT SECONDS COMMAND...: poll until COMMAND succeeds, else fail saying what
  local what=$1 limit=$2
  shift 2
  local end=$((SECONDS + limit))
  until "$@"; do
    if ((SECONDS >= end)); then
      echo "recipe: no $what after $limit s" >&2
      tail -20 "${driver_log:-$work/driver.out}" >&2   # the driver's output
      exit 1
    fi
    sleep 0.3
  done
}
