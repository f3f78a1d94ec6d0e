"use strict";
// Draws the snapshot page from the JSON in #data: the timeline (stacked by site, round byte ticks, time
// ticks since the trace start), the icicle of the peak, and the segment map.
const D = JSON.parse(document.getElementById("data").textContent);
const NS = "http://www.w3.org/2000/svg";
const COLORS = ["#4c78a8","#f58518","#e45756","#72b7b2","#54a24b","#eeca3b","#b279a2","#ff9da6","#9d755d","#bab0ac","#1f77b4","#2ca02c","#cccccc"];
const UNITS = ["B","KiB","MiB","GiB","TiB"];
const tip = document.getElementById("tip");
function fmt(b){let i=0;while(b>=1024&&i<4){b/=1024;i++;}return (i?b.toFixed(2):b)+" "+UNITS[i];}
// A round step near `v`: 1, 2 or 5 times a power of ten.
function niceStep(v){const e=Math.pow(10,Math.floor(Math.log10(v)));const m=v/e;return (m<=1?1:m<=2?2:m<=5?5:10)*e;}
// Byte ticks at round values of one binary unit: [unit index, step in that unit, top of the axis in bytes].
function byteTicks(max){
  let u=0; while(u<4&&max/Math.pow(1024,u+1)>=1)u++;
  const unit=Math.pow(1024,u), step=niceStep(max/unit/4), top=Math.max(step,Math.ceil(max/unit/step-1e-9)*step);
  return {u, unit, step, top: top*unit};
}
function fmtTick(v,u){const x=v/Math.pow(1024,u);return (Number.isInteger(x)?x:+x.toFixed(2))+" "+UNITS[u];}
function fmtMs(ms){return ms>=1000?(+(ms/1000).toFixed(3))+" s":(+ms.toFixed(3))+" ms";}
function el(tag, attrs, parent){const e=document.createElementNS(NS,tag);for(const k in attrs)e.setAttribute(k,attrs[k]);if(parent)parent.appendChild(e);return e;}
function hover(e, text){e.addEventListener("mousemove",ev=>{tip.style.display="block";tip.style.left=(ev.clientX+12)+"px";tip.style.top=(ev.clientY+12)+"px";tip.textContent=text;});e.addEventListener("mouseleave",()=>{tip.style.display="none";});}
function drawTimeline(){
  const svg=document.getElementById("timeline"), T=D.timeline;
  if(!T){el("text",{x:20,y:40},svg).textContent="No trace in this snapshot (record with _record_memory_history).";return;}
  const W=+svg.getAttribute("width")-80, H=+svg.getAttribute("height")-60, n=T.t_us.length, X0=70;
  let max=1; for(let b=0;b<n;b++){let s=0;for(const l of T.levels)s+=l[b];if(s>max)max=s;}
  const Y=byteTicks(max);
  const x=b=>X0+(n>1?b*W/(n-1):W/2), y=v=>10+H-v*H/Y.top;
  for(let k=0;k*Y.step*Y.unit<=Y.top*(1+1e-9);k++){
    const v=k*Y.step*Y.unit;
    el("line",{x1:X0,x2:X0+W,y1:y(v),y2:y(v),stroke:"#eee",class:"ytick"},svg);
    el("text",{x:X0-6,y:y(v)+4,"font-size":10,"text-anchor":"end",class:"ylabel"},svg).textContent=fmtTick(v,Y.u);
  }
  const base=new Array(n).fill(0);
  T.levels.forEach((lv,si)=>{
    const top=base.map((v,b)=>v+lv[b]);
    let d="M"+x(0)+","+y(top[0]);
    for(let b=1;b<n;b++)d+="L"+x(b)+","+y(top[b]);
    for(let b=n-1;b>=0;b--)d+="L"+x(b)+","+y(base[b]);
    const p=el("path",{d:d+"Z",fill:COLORS[si%COLORS.length],class:"band"},svg);
    hover(p,T.series[si]+" — peak "+fmt(Math.max(...lv)));
    for(let b=0;b<n;b++)base[b]=top[b];
  });
  // Time ticks: round times since the trace start, placed at the first bucket that reaches them.
  const t0=T.start_us, spanMs=(T.t_us[n-1]-t0)/1000;
  if(spanMs>0){
    const step=niceStep(spanMs/6);
    let b=0;
    for(let k=0;k*step<=spanMs*(1+1e-9);k++){
      const ms=k*step; while(b<n-1&&(T.t_us[b]-t0)/1000<ms)b++;
      el("line",{x1:x(b),x2:x(b),y1:10+H,y2:15+H,stroke:"#999",class:"xtick"},svg);
      el("text",{x:x(b),y:H+27,"font-size":10,"text-anchor":"middle",class:"xlabel"},svg).textContent=fmtMs(ms);
    }
  }
  el("text",{x:X0,y:H+47,"font-size":10},svg).textContent="time since the trace start ("+fmtMs(spanMs)+" across "+n+" buckets of equal event counts; each bucket shows its highest moment)";
  const leg=document.getElementById("timeline-legend");
  T.series.forEach((s,i)=>{const sp=document.createElement("span");const c=document.createElement("i");c.style.background=COLORS[i%COLORS.length];sp.appendChild(c);sp.appendChild(document.createTextNode(s));leg.appendChild(sp);});
}
function drawIcicle(){
  const svg=document.getElementById("icicle"), root=D.icicle, W=+svg.getAttribute("width"), RH=18;
  let maxDepth=0;
  function walk(nd,x0,w,depth){
    if(w<0.5)return; maxDepth=Math.max(maxDepth,depth);
    const r=el("rect",{x:x0,y:depth*RH,width:Math.max(w-1,0.5),height:RH-1,fill:COLORS[depth%COLORS.length],class:"node"},svg);
    hover(r,nd.n+" — "+fmt(nd.v)+" ("+(100*nd.v/Math.max(root.v,1)).toFixed(1)+"%)");
    if(w>60){const t=el("text",{x:x0+3,y:depth*RH+13,"font-size":11,"pointer-events":"none"},svg);t.textContent=(nd.n.replace(/^[^:]*\//,"")+" "+fmt(nd.v)).slice(0,Math.floor(w/6.5));}
    let cx=x0; for(const c of nd.c){const cw=w*c.v/Math.max(nd.v,1);walk(c,cx,cw,depth+1);cx+=cw;}
  }
  walk(root,0,W,0);
  svg.setAttribute("height",(maxDepth+1)*RH+4);
}
function drawSegments(){
  const svg=document.getElementById("segments"), S=D.segments.segments, W=+svg.getAttribute("width")-170, RH=10;
  const SC=["#4c78a8","#f58518","#bbbbbb","#9467bd"]; let maxT=1; for(const s of S)maxT=Math.max(maxT,s.total);
  S.forEach((s,i)=>{
    const y=i*RH; el("text",{x:0,y:y+8,"font-size":8},svg).textContent=s.addr+" "+fmt(s.total);
    const w=Math.max(W*Math.sqrt(s.total/maxT),2); let x=170;
    for(const [st,b] of s.runs){const rw=w*b/Math.max(s.total,1);const r=el("rect",{x:x,y:y,width:Math.max(rw,0.3),height:RH-2,fill:SC[st],class:"run"},svg);hover(r,["allocated","pending free","inactive","mixed"][st]+" "+fmt(b)+" in segment "+s.addr);x+=rw;}
  });
  svg.setAttribute("height",Math.max(S.length*RH+20,30));
  if(D.segments.hidden)el("text",{x:0,y:S.length*RH+16,"font-size":10},svg).textContent="… and "+D.segments.hidden+" smaller segments";
}
drawTimeline(); drawIcicle(); drawSegments();
document.body.setAttribute("data-rendered","1");
