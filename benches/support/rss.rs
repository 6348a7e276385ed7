//! Resident memory of a process, from `/proc`.

/// VmRSS of process `pid` (`"self"` for this one), in KiB.
pub fn rss_kib(pid: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

/// Major page faults of process `pid` so far (pages read back from disk), from `/proc/PID/stat`
/// (0 once it is gone).
pub fn major_faults(pid: u32) -> u64 {
    stat_fields(pid).get(9).map_or(0, |&faults| faults as u64)
}

/// Seconds CPU `cpu` has spent busy (anything but idle and I/O wait), from `/proc/stat`.
pub fn cpu_busy_seconds(cpu: &str) -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap();
    let name = format!("cpu{cpu}");
    let Some(line) = stat
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name.as_str()))
    else {
        return f64::NAN;
    };
    // user nice system idle iowait irq softirq steal ...
    let ticks: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .map(|t| t.parse().unwrap_or(0.0))
        .collect();
    let busy: f64 = [0, 1, 2, 5, 6, 7]
        .iter()
        .map(|&i| ticks.get(i).copied().unwrap_or(0.0))
        .sum();
    busy / 100.0
}

/// User plus system CPU seconds process `pid` has used, from `/proc/PID/stat` (0 once it is
/// gone).
pub fn cpu_seconds(pid: u32) -> f64 {
    let fields = stat_fields(pid);
    let ticks = |i: usize| fields.get(i).copied().unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// The fields of `/proc/PID/stat` after the command name (0: the state), each as a number (0
/// where it is none); none once the process is gone.
fn stat_fields(pid: u32) -> Vec<f64> {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return Vec::new();
    };
    // The command name is in parentheses and may hold spaces.
    let Some(end) = stat.rfind(')') else {
        return Vec::new();
    };
    stat[end + 1..]
        .split_whitespace()
        .map(|field| field.parse().unwrap_or(0.0))
        .collect()
}

/// The control plane whose folder is `dir`: its etcd, kube-apiserver and
/// kube-controller-manager, by their program's name.
pub fn processes_under(dir: &std::path::Path) -> Vec<(String, u32)> {
    // With the separator: a folder `...-1` must not match `...-10`.
    let dir = format!("{}/", dir.display());
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline);
        let program = cmdline.split('\0').next().unwrap_or_default();
        let name = program.rsplit('/').next().unwrap_or(program).to_owned();
        // Replicas name the folder too (their kubeconfig): only the control plane's own.
        if cmdline.contains(&dir) && (name == "etcd" || name.starts_with("kube-")) {
            found.push((name, pid));
        }
    }
    found.sort();
    found
}
